"""Change-point estimates for a test's pooled-residual path, to date an alarm's shift (research:
the alert keeps the CUSUM's last zero, which none of these beat on the design data, docs/METHOD.md 8c).

Inputs: ``steps`` (training steps of the checks, increasing) and ``u`` (the pooled standardised
residual of one test at each check, residual units: unit variance and mean 0 when healthy,
positive in the fault direction, as :mod:`~mechmon_megatron.detect.pooled_cusum` computes it).
Index ``t`` counts checks (0-based); ``n = len(u)``.

Every estimate is a **step**: the step of the last check *before* the shift, i.e. the check after
which the shift began (the convention of the CUSUM's last zero, ``PooledAlarm.change_step``). A
shift fitted from the first value on (``tau == 0``) returns None: it began at an unknown earlier
step.

* :func:`mean_shift_change_point`: the maximum-likelihood change point of a step in the mean of
  unknown size ``mu >= 0``: ``u_t ~ N(0, 1)`` for ``t < tau``, ``N(mu, 1)`` for ``t >= tau``.
  With ``m = n - tau`` and the suffix sum ``U(tau) = sum_{t >= tau} u_t`` the profile
  log-likelihood ratio against "no shift" is ``LLR(tau) = max(0, U(tau))**2 / (2 m)``.
* :func:`ramp_change_point`: the same for a linear ramp of unknown slope ``beta >= 0``:
  ``u_t = beta * (t - tau + 1) + noise`` for ``t >= tau`` (0 up to the check ``tau - 1``). With
  weights ``w_t = t - tau + 1``: ``LLR(tau) = max(0, N(tau))**2 / (2 D(m))``, where
  ``N(tau) = sum_{t >= tau} w_t u_t`` and ``D(m) = sum_{j=1..m} j**2 = m (m + 1) (2 m + 1) / 6``.
  A slowly growing fault (its effect ramping up) fits a ramp better than a step, whose fitted
  start is pulled late towards the larger values.
* :func:`cusum_last_zero`: the detector's own estimate, ``_Cusum.update``'s recurrence
  ``S_t = max(0, S_{t-1} + u_t - reference)`` (``S_{-1} = 0``): at each update with
  ``S_{t-1} <= 0`` the last zero becomes the previous check's step.

Both likelihood scans are O(n): ``U(tau) = u_tau + U(tau + 1)`` and ``N(tau) = N(tau + 1) + U(tau)``
(each later value's weight grows by one when the start moves one check earlier), so no ``t * u``
sum and its cancellation are needed. Ties in ``LLR`` go to the earliest ``tau``; a path with no
positive suffix sum has ``LLR == 0`` everywhere and so ``tau == 0`` (None).

Pure Python, standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "ChangePointFit",
    "cusum_last_zero",
    "mean_shift_change_point",
    "mean_shift_fit",
    "ramp_change_point",
    "ramp_fit",
]


@dataclass(frozen=True, slots=True)
class ChangePointFit:
    """The maximiser of a change-point scan over one path."""

    index: int
    """``tau``: the first check (0-based index into the path) that carries the shift."""
    llr: float
    """Its log-likelihood ratio against "no shift" (>= 0; nats)."""


def _argmax_earliest(llrs: Sequence[float]) -> ChangePointFit:
    """The first index of the largest value (``llrs`` is indexed by tau)."""
    best = 0
    for tau in range(1, len(llrs)):
        if llrs[tau] > llrs[best]:
            best = tau
    return ChangePointFit(index=best, llr=llrs[best])


def mean_shift_fit(u: Sequence[float]) -> Optional[ChangePointFit]:
    """Maximum-likelihood start of a mean shift >= 0 in unit-variance residuals; None for no values."""
    n = len(u)
    if n == 0:
        return None
    llrs = [0.0] * n
    suffix = 0.0  # U(tau)
    for tau in range(n - 1, -1, -1):
        suffix += u[tau]
        llrs[tau] = max(0.0, suffix) ** 2 / (2 * (n - tau))
    return _argmax_earliest(llrs)


def ramp_fit(u: Sequence[float]) -> Optional[ChangePointFit]:
    """Maximum-likelihood start of a linear ramp (slope >= 0) in unit-variance residuals; None for
    no values."""
    n = len(u)
    if n == 0:
        return None
    llrs = [0.0] * n
    suffix = 0.0  # U(tau)
    weighted = 0.0  # N(tau) = N(tau + 1) + U(tau)
    for tau in range(n - 1, -1, -1):
        suffix += u[tau]
        weighted += suffix
        m = n - tau
        llrs[tau] = max(0.0, weighted) ** 2 / (2 * (m * (m + 1) * (2 * m + 1) / 6))
    return _argmax_earliest(llrs)


def _step_before(steps: Sequence[int], fit: Optional[ChangePointFit]) -> Optional[int]:
    """The step of the check before the fitted start; None when it is the first check."""
    if fit is None or fit.index == 0:
        return None
    return int(steps[fit.index - 1])


def _check_lengths(steps: Sequence[int], u: Sequence[float]) -> None:
    if len(steps) != len(u):
        raise ValueError(f"steps and u differ in length: {len(steps)} != {len(u)}.")


def mean_shift_change_point(steps: Sequence[int], u: Sequence[float]) -> Optional[int]:
    """Step of the last check before the maximum-likelihood mean shift (see the module docstring);
    None when the shift is fitted from the first check on, or for an empty path."""
    _check_lengths(steps, u)
    return _step_before(steps, mean_shift_fit(u))


def ramp_change_point(steps: Sequence[int], u: Sequence[float]) -> Optional[int]:
    """Step of the last check before the maximum-likelihood ramp start (see the module docstring);
    None when the ramp is fitted from the first check on, or for an empty path."""
    _check_lengths(steps, u)
    return _step_before(steps, ramp_fit(u))


def cusum_last_zero(
    steps: Sequence[int], u: Sequence[float], reference: float = 1.0, previous_step: Optional[int] = None
) -> Optional[int]:
    """The detector's change point after the path: the CUSUM ``S_t = max(0, S_{t-1} + u_t - reference)``
    (``S`` starts at 0) run over ``u``; each update that finds ``S_{t-1} <= 0`` records the step of
    the check before it (``steps[t-1]``, or ``previous_step`` for the first value: the detector's
    previous check, which precedes the test's first residual; None when unknown).

    Equals ``PooledAlarm.change_step`` of a CUSUM alarm at ``steps[-1]`` when ``u`` is the test's
    residuals since its CUSUM (re)started and each check's previous check is the path's previous
    one. None for an empty path."""
    _check_lengths(steps, u)
    value = 0.0
    last_zero: Optional[int] = None
    for t, x in enumerate(u):
        if value <= 0.0:
            last_zero = previous_step if t == 0 else int(steps[t - 1])
        value = max(0.0, value + x - reference)
    return last_zero
