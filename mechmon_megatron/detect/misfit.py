"""Calibration misfit: does the job's healthy phase cross the warning level more often than the
null tails predict?

The thresholds come from fitted null tails (``detect.null_model``): every test's warning level
``w`` was set so that ``P0(S > w) <= p_w`` per check. By the union bound, the expected number of
warning *episodes* (checks where a test's statistic crosses ``w`` upwards) over ``n`` test-checks
is at most ``n p_w``. Episodes of a rare level are close to Poisson (the clumps of one excursion
count once), so before the family's first alarm the observed count ``k`` is compared with a
Poisson(``n p_w``) law: the family's calibration misfits when ``P(K >= k) < MISFIT_P_VALUE``.

Why episodes, not exceedances: a CUSUM that crosses ``w`` stays above it for several checks
(autocorrelated), which would make a count of exceedances over-dispersed and the Poisson test
fire on a well-calibrated job. Counting upcrossings can only under-count (the union bound holds
for them), so the test errs towards silence on a tail that fits, and still fires when the tail
is too light: a heavier tail than fitted crosses the warning level many times more often.

Why 1e-3: the test is re-evaluated at every new episode (a handful per job) and per family
(four), so its job-wide chance of firing on a tail that fits stays near 1 %; the warning level
sits at 1,000 x the alarm probability, so a tail too light by the factors that matter (the
alarm rate off by 10x or more) shows as tens of episodes where fewer than one is expected.
Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MISFIT_P_VALUE", "MisfitCounter", "poisson_upper_tail"]

MISFIT_P_VALUE = 1e-3
"""One-sided Poisson p-value below which a family's calibration is declared a misfit."""


def poisson_upper_tail(k: int, mean: float) -> float:
    """``P(K >= k)`` for ``K ~ Poisson(mean)`` (summed in log space from ``k`` upwards)."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    if k <= mean:
        below = math.fsum(math.exp(-mean + j * math.log(mean) - math.lgamma(j + 1)) for j in range(k))
        return max(0.0, 1.0 - below)
    total = 0.0
    j = k
    while True:
        term = math.exp(-mean + j * math.log(mean) - math.lgamma(j + 1))
        total += term
        if term < 1e-18 * max(total, 1e-300) or j > k + 10_000:
            return min(1.0, total)
        j += 1


@dataclass
class _Count:
    test_checks: int = 0
    """Sum over checks of the family's tests updated at that check (before its first alarm)."""
    episodes: int = 0
    """Upward crossings of the warning level by any of the family's tests (before its first alarm)."""
    fired: bool = False


class MisfitCounter:
    """Per family: healthy-phase warning episodes against the tail model's prediction.

    ``warning_probability``: the per-test, per-check null probability of the warning level."""

    def __init__(self, warning_probability: float, p_value: float = MISFIT_P_VALUE) -> None:
        if not 0 < warning_probability < 1:
            raise ValueError(f"warning probability must be in (0, 1), got {warning_probability}.")
        self.warning_probability = warning_probability
        self.p_value = p_value
        self._counts: dict[str, _Count] = {}

    def count(self, family: str, tests: int, episodes: int) -> bool:
        """Add one healthy check of ``tests`` tests with ``episodes`` new warning episodes;
        True when the family's misfit fires now (once per family)."""
        c = self._counts.setdefault(family, _Count())
        c.test_checks += tests
        c.episodes += episodes
        if c.fired or episodes == 0:
            return False
        if poisson_upper_tail(c.episodes, self.expected(family)) < self.p_value:
            c.fired = True
            return True
        return False

    def expected(self, family: str) -> float:
        c = self._counts.get(family)
        return 0.0 if c is None else c.test_checks * self.warning_probability

    def fired(self, family: str) -> bool:
        c = self._counts.get(family)
        return bool(c and c.fired)

    def statistics(self, family: str) -> dict[str, float]:
        c = self._counts.get(family, _Count())
        return {
            f"{family}/calibration_misfit": 1.0 if c.fired else 0.0,
            f"{family}/calibration_misfit/observed": float(c.episodes),
            f"{family}/calibration_misfit/expected": self.expected(family),
        }

    def state_dict(self) -> dict[str, Any]:
        return {f: [c.test_checks, c.episodes, c.fired] for f, c in sorted(self._counts.items())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._counts = {f: _Count(int(n), int(k), bool(fired)) for f, (n, k, fired) in state.items()}
