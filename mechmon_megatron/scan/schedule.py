"""Which checkpoint pairs a scan compares, and the check interval / window in training steps.

With checkpoints ``c_0 .. c_{n-1}`` (sorted by iteration), ``--window k`` and ``--every e``, the
scan judges ``c_i`` against ``c_{i-k}`` for ``i = k, k + e, k + 2e, ...``. Each judged pair is
one detector check at step ``iteration(c_i)``. In the online session's terms, the check interval
is ``e x g`` steps and the increment window ``delta = k x g`` steps, with ``g`` the save
interval: the median gap between consecutive checkpoints (irregular gaps, e.g. an extra save at
the end of training, are kept and reported in the summary's notes).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from mechmon_megatron.scan.series import CheckpointRef, SkippedCheckpoint

__all__ = ["ScanPlan", "make_plan"]


@dataclass(frozen=True, slots=True)
class ScanPlan:
    checkpoints: tuple[CheckpointRef, ...]
    pairs: tuple[tuple[int, int], ...]
    """(index of the earlier checkpoint, index of the later one), in check order."""
    save_interval: int
    """Median gap between consecutive checkpoints (steps)."""
    interval: int
    """Steps between checks (``every`` x ``save_interval``)."""
    delta: int
    """Increment window in steps (``window`` x ``save_interval``)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    skipped: tuple[SkippedCheckpoint, ...] = ()
    """Folders named like checkpoints of the series that could not be read (left out)."""

    def iterations(self, pair: tuple[int, int]) -> tuple[int, int]:
        return self.checkpoints[pair[0]].iteration, self.checkpoints[pair[1]].iteration


def make_plan(refs: list[CheckpointRef], every: int, window: int,
              skipped: tuple[SkippedCheckpoint, ...] = ()) -> ScanPlan:
    gaps = [b.iteration - a.iteration for a, b in zip(refs, refs[1:])]
    save_interval = max(1, int(statistics.median_low(gaps)))
    notes = []
    odd = [(a.iteration, b.iteration) for a, b in zip(refs, refs[1:]) if b.iteration - a.iteration != save_interval]
    if odd:
        notes.append(
            f"irregular checkpoint spacing: save interval taken as the median gap {save_interval} steps; pairs "
            f"{odd[:5]}{' ...' if len(odd) > 5 else ''} have other gaps (their increments span other windows)"
        )
    pairs = tuple((i - window, i) for i in range(window, len(refs), every))
    return ScanPlan(
        checkpoints=tuple(refs), pairs=pairs, save_interval=save_interval, interval=every * save_interval,
        delta=window * save_interval, notes=tuple(notes), skipped=tuple(skipped),
    )
