"""Can these records calibrate this schedule? Their check interval, and whether each family gets
detector statistics at all.

A stream's baseline forms from its first ``warmup_checks(interval)`` accepted values
(``detect.pooled_cusum``); only the checks after that produce CUSUM values and residuals, the
null statistics the tails are fitted on. A family whose every run ends before that has nothing to
fit: the calibration would leave it out and the trainer refuse the file, so it is refused here,
naming the family and how many checks it needs against how many the runs have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from mechmon_megatron.calibrate.errors import CalibrationError
from mechmon_megatron.calibrate.replay import Checks, subsample
from mechmon_megatron.detect.pooled_cusum import warmup_checks
from mechmon_megatron.session.detector_inputs import observations_from_scalars

__all__ = ["FamilyCoverage", "check_interval", "family_coverage", "recorded_interval"]


def recorded_interval(checks: Checks) -> Optional[int]:
    """The check interval (steps) a run was recorded at: the greatest common divisor of the gaps
    between its distinct check steps (a resume with a longer interval, or a skipped check, leaves
    it unchanged); None with fewer than two distinct steps."""
    steps = sorted({step for step, _ in checks})
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return math.gcd(*gaps) if gaps else None


def check_interval(series: Sequence[Checks], names: Sequence[str], interval: int) -> None:
    """:class:`CalibrationError` naming the first run whose checks were made at another interval
    than ``interval`` (``--interval``): the detector's warm-up and the tails' overlap follow the
    interval, so a fit at the wrong one fits another detector."""
    for checks, name in zip(series, names):
        recorded = recorded_interval(checks)
        if recorded is not None and recorded != interval:
            raise CalibrationError(
                f"{name}: its checks are {recorded} steps apart, so it was recorded at --mechmon-interval {recorded}, "
                f"not --interval {interval}; pass --interval {recorded} (and the --mechmon-delta it was recorded "
                "with as --delta)")


@dataclass(frozen=True, slots=True)
class FamilyCoverage:
    """How far the run that comes closest gets towards a family's first detector statistic."""

    family: str
    run: str
    """The run with the most checks to spare (or the fewest missing)."""
    needs: int
    """Checks that run needs before its first statistic: those before the family's first value,
    plus the warm-up, plus the first judged check."""
    has: int
    """Checks that run has at this schedule."""
    warmup: int
    """Checks of warm-up at this schedule's interval (``detect.pooled_cusum.warmup_checks``)."""

    @property
    def short(self) -> bool:
        return self.has < self.needs

    def message(self, interval: int) -> str:
        """One line: the family, what it needs and what the records have, at ``interval``."""
        return (f"detector family {self.family!r} cannot be fitted at interval {interval}: a run needs at least "
                f"{self.needs} checks for its first statistic ({self.needs - 1 - self.warmup} before its first "
                f"value, {self.warmup} of baseline warm-up, 1 judged) and the run closest to that ({self.run}) has "
                f"{self.has}; record longer healthy runs")


def family_coverage(series: Sequence[Checks], names: Sequence[str], interval: int,
                    every: int = 1) -> dict[str, FamilyCoverage]:
    """Per family seen in the records, its coverage at the schedule that keeps every ``every``-th
    check of runs recorded every ``interval`` steps (check interval ``every * interval``)."""
    warmup = warmup_checks(interval * every)
    best: dict[str, FamilyCoverage] = {}
    for checks, name in zip(series, names):
        kept = checks if every == 1 else subsample(checks, interval, every)
        first: dict[str, int] = {}
        for index, (_, scalars) in enumerate(kept):
            for obs in observations_from_scalars(scalars):
                if math.isfinite(obs.value):
                    first.setdefault(obs.family, index)
        for family, index in first.items():
            here = FamilyCoverage(family=family, run=name, needs=index + warmup + 1, has=len(kept), warmup=warmup)
            known = best.get(family)
            if known is None or here.has - here.needs > known.has - known.needs:
                best[family] = here
    return best
