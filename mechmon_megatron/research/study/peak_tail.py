"""A heavier tail model for the per-step attention-logit CUSUM: declustered peaks over a threshold
with a generalised Pareto (GPD) tail (issue 19, round 7 addendum; docs/RESULTS.md).

The exponential tail of ``detect.null_model`` is fitted on every step's CUSUM value. The per-step
logit CUSUM's healthy excursions last tens to hundreds of steps, and round 7's leave-one-out check
rejected that fit (one run in five reaches 43 CUSUM units where the other four predict 39 at
p = 4.8e-10 per step). The standard extreme-value answer is to model the peak of each excursion:

- a **cluster** is a maximal run of consecutive steps with CUSUM > ``CLUSTER_FLOOR`` (one CUSUM
  unit, the reference k = 1); its **peak** is its largest value;
- peaks above ``PEAK_THRESHOLD`` u arrive at ``rate`` clusters per step, and their excesses
  ``y = peak - u`` follow a GPD: ``P(Y > y) = (1 + xi y / sigma)^(-1/xi)`` (``exp(-y / sigma)`` at
  xi = 0), fitted by maximum likelihood;
- a run of n steps reaches h with probability ``1 - exp(-n rate P(Y > h - u))`` (Poisson clusters),
  and the level for a per-step false-alarm probability p solves ``rate P(Y > h - u) = p``.

``CLUSTER_FLOOR`` and ``PEAK_THRESHOLD`` were fixed before the check below was run on any run
held out from it (about 100 of the five tail runs' 1,817 peaks lie above u = 4). Research code:
numpy, no scipy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

CLUSTER_FLOOR = 1.0
"""CUSUM units: a cluster ends when the CUSUM falls to this or below."""
PEAK_THRESHOLD = 4.0
"""CUSUM units: peaks above this are modelled by the GPD."""


def cluster_peaks(values: Sequence[float], floor: float = CLUSTER_FLOOR) -> list[float]:
    """The largest value of each maximal run of consecutive finite values > ``floor``, in order."""
    peaks: list[float] = []
    current = None
    for x in values:
        if math.isfinite(x) and x > floor:
            current = x if current is None else max(current, x)
        elif current is not None:
            peaks.append(current)
            current = None
    if current is not None:
        peaks.append(current)
    return peaks


def gpd_log_likelihood(excesses: np.ndarray, xi: float, sigma: float) -> float:
    """Log-likelihood of GPD(xi, sigma) for ``excesses`` (>= 0); -inf outside the support."""
    if sigma <= 0:
        return -math.inf
    if abs(xi) < 1e-9:
        return float(-len(excesses) * math.log(sigma) - excesses.sum() / sigma)
    z = 1.0 + xi * excesses / sigma
    if np.any(z <= 0):
        return -math.inf
    return float(-len(excesses) * math.log(sigma) - (1.0 + 1.0 / xi) * np.log(z).sum())


def _golden_max(f, lo: float, hi: float, iters: int = 80) -> tuple[float, float]:
    """(argmax, max) of a unimodal ``f`` on [lo, hi] by golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    x = (a + b) / 2
    return x, f(x)


def _profile(y: np.ndarray, xi: float) -> tuple[float, float]:
    """(log-likelihood, sigma) maximised over sigma at this xi (golden section on log sigma)."""
    scale = float(y.mean())
    # For xi < 0 the support needs sigma > -xi max(y).
    lo = math.log(max(1e-9, -xi * float(y.max()) * (1 + 1e-9))) if xi < 0 else math.log(scale) - 12
    log_s, ll = _golden_max(lambda ls: gpd_log_likelihood(y, xi, math.exp(ls)), lo, math.log(scale) + 12)
    return ll, math.exp(log_s)


def _excesses(excesses: Sequence[float]) -> np.ndarray:
    y = np.asarray([v for v in excesses if v >= 0], dtype=float)
    if len(y) < 10:
        raise ValueError(f"need at least 10 excesses to fit a GPD, got {len(y)}")
    return y


XI_GRID = np.arange(-0.45, 1.5001, 0.01)


def fit_gpd(excesses: Sequence[float]) -> tuple[float, float]:
    """Maximum-likelihood (xi, sigma) of a GPD for positive ``excesses``: the profile likelihood in
    sigma (golden section on log sigma) over a grid of xi in [-0.45, 1.5], refined around its best
    point. Needs at least 10 excesses."""
    y = _excesses(excesses)
    best = max(XI_GRID, key=lambda xi: _profile(y, float(xi))[0])
    xi, _ = _golden_max(lambda x: _profile(y, x)[0], max(-0.45, best - 0.01), min(1.5, best + 0.01), iters=40)
    return float(xi), _profile(y, xi)[1]


def xi_lower_bound(excesses: Sequence[float], drop: float = 1.92) -> float:
    """The smallest xi on the grid whose profile log-likelihood is within ``drop`` of the maximum
    (1.92: the 95 % profile-likelihood interval's lower end, to the grid's 0.01)."""
    y = _excesses(excesses)
    profile = [(float(xi), _profile(y, float(xi))[0]) for xi in XI_GRID]
    top = max(ll for _, ll in profile)
    return min(xi for xi, ll in profile if ll >= top - drop)


def gpd_survival(y: float, xi: float, sigma: float) -> float:
    """P(Y > y) of GPD(xi, sigma), y >= 0 (0 beyond a bounded support)."""
    y = max(0.0, y)
    if abs(xi) < 1e-9:
        return math.exp(-y / sigma)
    z = 1.0 + xi * y / sigma
    return 0.0 if z <= 0 else z ** (-1.0 / xi)


@dataclass(frozen=True, slots=True)
class PeakTail:
    """The fitted model: clusters above ``u`` per step and the GPD of their excesses."""

    u: float
    rate: float
    """Clusters with a peak above ``u`` per step."""
    xi: float
    sigma: float
    peaks_above: int
    steps: int
    xi_low: float
    """Lower end of the 95 % profile-likelihood interval of xi (the lightest plausible tail)."""
    sigma_low: float
    """sigma at ``xi_low`` (profiled)."""

    def p_step(self, h: float) -> float:
        """Probability per step that a cluster peak exceeds ``h`` (h >= u)."""
        return self.rate * gpd_survival(h - self.u, self.xi, self.sigma)

    def lightest(self) -> PeakTail:
        """The same clusters with the lightest plausible tail (``xi_low``, ``sigma_low``)."""
        return PeakTail(u=self.u, rate=self.rate, xi=self.xi_low, sigma=self.sigma_low, peaks_above=self.peaks_above,
                        steps=self.steps, xi_low=self.xi_low, sigma_low=self.sigma_low)

    def p_max(self, h: float, steps: int) -> float:
        """Probability that a run of ``steps`` steps reaches ``h`` (Poisson clusters)."""
        return -math.expm1(-steps * self.p_step(h))

    def level(self, p_step: float) -> float:
        """The h with ``p_step(h) = p_step`` (``p_step`` > 0; u when clusters above u are rarer)."""
        q = p_step / self.rate
        if q >= 1:
            return self.u
        if abs(self.xi) < 1e-9:
            return self.u - self.sigma * math.log(q)
        return self.u + self.sigma / self.xi * (q ** (-self.xi) - 1.0)


def fit_peak_tail(cusums: Mapping[str, Sequence[float]], runs: Sequence[str], u: float = PEAK_THRESHOLD,
                  floor: float = CLUSTER_FLOOR) -> PeakTail:
    """The peak tail of the pooled clusters of exactly ``runs`` (each run declustered on its own)."""
    peaks: list[float] = []
    steps = 0
    for r in runs:
        peaks += cluster_peaks(cusums[r], floor)
        steps += sum(1 for v in cusums[r] if math.isfinite(v))
    above = [p - u for p in peaks if p > u]
    xi, sigma = fit_gpd(above)
    xi_low = xi_lower_bound(above)
    return PeakTail(u=u, rate=len(above) / steps, xi=xi, sigma=sigma, peaks_above=len(above), steps=steps,
                    xi_low=xi_low, sigma_low=_profile(_excesses(above), xi_low)[1])


@dataclass(frozen=True, slots=True)
class PeakCheck:
    """One held-out run under the peak tail of the others."""

    held_out: str
    max_cusum: float
    steps: int
    alarm_level: float
    """Level the others give at the per-step probability (maximum-likelihood tail)."""
    alarm_level_lightest: float
    """The same with the lightest plausible tail (``PeakTail.lightest``)."""
    p_max: float
    """Probability under the others' tail that a run of ``steps`` steps reaches ``max_cusum``."""
    xi: float
    sigma: float


def peak_tail_check(cusums: Mapping[str, Sequence[float]], fitted_on: Sequence[str], held_out: Sequence[str],
                    p_step: float) -> list[PeakCheck]:
    """Each of ``held_out`` against the peak tail fitted on ``fitted_on`` minus itself (leave one
    out when the run is among them; a plain out-of-sample check when it is not)."""
    out = []
    for held in held_out:
        tail = fit_peak_tail(cusums, [r for r in fitted_on if r != held])
        values = [float(v) for v in cusums[held] if math.isfinite(v)]
        top = max(values)
        p_max = tail.p_max(top, len(values)) if top > tail.u else 1.0
        out.append(PeakCheck(held_out=held, max_cusum=top, steps=len(values), alarm_level=tail.level(p_step),
                             alarm_level_lightest=tail.lightest().level(p_step), p_max=p_max, xi=tail.xi,
                             sigma=tail.sigma))
    return out
