"""A symptom rule's threshold set the way the detector's are: from healthy runs, through a tail model
that leave-one-run-out does not reject, at the detector's false-alarm rate (docs/METHOD.md 8c).

A growth rule (e.g. ``max_attn_logit``) alarms when its score reaches a threshold at any step, so a
healthy run of ``n`` steps alarms falsely exactly when the run's largest score does. The per-run
maxima of healthy runs of one length are modelled by a Gumbel law ``F(x) = exp(-exp(-(x - mu) /
beta))`` (the limit law of maxima of light-tailed scores), fitted by maximum likelihood; the
threshold for a per-run false-alarm probability ``p`` is its ``1 - p`` quantile. The detector's
``R`` false alarms per 10^6 steps is ``p = R * n / 10^6`` for a run of ``n`` steps.

Leave-one-run-out: each run's maximum is judged by the law fitted on the others, ``P(M >= x_i)``;
the model is rejected when the smallest of these, times the number of runs (Bonferroni), is below
``alpha``. Standard library only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Gumbel", "RuleCalibration", "calibrate_rule", "fit_gumbel", "leave_one_out", "per_run_probability"]


@dataclass(frozen=True)
class Gumbel:
    """The law of a run's largest score: location ``mu``, scale ``beta > 0`` (score units)."""

    mu: float
    beta: float

    def survival(self, x: float) -> float:
        """``P(M >= x)``."""
        return -math.expm1(-math.exp(-(x - self.mu) / self.beta))

    def quantile_above(self, p: float) -> float:
        """The level a run's maximum exceeds with probability ``p`` (0 < p < 1)."""
        if not 0.0 < p < 1.0:
            raise ValueError(f"p must be in (0, 1), got {p}")
        return self.mu - self.beta * math.log(-math.log1p(-p))


def _beta_equation(beta: float, xs: Sequence[float]) -> float:
    """Zero at the maximum-likelihood scale: ``beta - mean(x) + sum(x w) / sum(w)``, ``w = exp(-x / beta)``
    (the weights shifted by the smallest value for range)."""
    low = min(xs)
    weights = [math.exp(-(x - low) / beta) for x in xs]
    return beta - sum(xs) / len(xs) + sum(x * w for x, w in zip(xs, weights)) / sum(weights)


def fit_gumbel(maxima: Sequence[float]) -> Gumbel:
    """The maximum-likelihood Gumbel law of ``maxima`` (at least 3 values, not all equal)."""
    xs = [float(x) for x in maxima]
    if len(xs) < 3 or max(xs) == min(xs) or not all(math.isfinite(x) for x in xs):
        raise ValueError(f"a Gumbel fit needs at least 3 finite maxima that differ, got {xs}")
    spread = max(xs) - min(xs)
    lo, hi = spread * 1e-6, spread * 1e3  # the equation is negative at lo and positive at hi
    for _ in range(200):  # bisection: monotone in beta, no derivative to get wrong
        mid = 0.5 * (lo + hi)
        if _beta_equation(mid, xs) > 0:
            hi = mid
        else:
            lo = mid
    beta = 0.5 * (lo + hi)
    low = min(xs)
    mu = low - beta * math.log(sum(math.exp(-(x - low) / beta) for x in xs) / len(xs))
    return Gumbel(mu=mu, beta=beta)


def per_run_probability(rate_per_million_steps: float, run_steps: int) -> float:
    """The per-run false-alarm probability of ``R`` false alarms per 10^6 steps over ``run_steps`` steps."""
    return rate_per_million_steps * run_steps / 1e6


def leave_one_out(maxima: Sequence[float]) -> list[float]:
    """``P(M >= x_i)`` under the law fitted on the other runs, for each run ``i``."""
    xs = list(maxima)
    return [fit_gumbel(xs[:i] + xs[i + 1:]).survival(x) for i, x in enumerate(xs)]


@dataclass(frozen=True)
class RuleCalibration:
    """A rule's threshold at one per-run false-alarm probability, and the evidence for its tail model."""

    law: Gumbel
    per_run_probability: float
    threshold: float
    held_out_p: tuple[float, ...]
    """Leave-one-run-out ``P(M >= x_i)`` per run."""
    rejected: bool
    """The smallest held-out probability times the number of runs is below ``alpha``."""
    bootstrap_interval: tuple[float, float]
    """The threshold's 5 % and 95 % quantiles over refits on runs drawn with replacement."""


def calibrate_rule(maxima: Sequence[float], per_run_p: float, alpha: float = 0.05, resamples: int = 2000,
                   seed: int = 0) -> RuleCalibration:
    """Fit, judge by leave-one-run-out and extrapolate: the threshold a healthy run's maximum exceeds
    with probability ``per_run_p``."""
    law = fit_gumbel(maxima)
    held_out = leave_one_out(maxima)
    rng = random.Random(seed)
    xs = list(maxima)
    levels = []
    for _ in range(resamples):
        sample = [rng.choice(xs) for _ in xs]
        if max(sample) > min(sample):
            levels.append(fit_gumbel(sample).quantile_above(per_run_p))
    levels.sort()
    interval = (levels[int(0.05 * (len(levels) - 1))], levels[int(0.95 * (len(levels) - 1))])
    return RuleCalibration(law=law, per_run_probability=per_run_p, threshold=law.quantile_above(per_run_p),
                           held_out_p=tuple(held_out), rejected=min(held_out) * len(xs) < alpha,
                           bootstrap_interval=interval)
