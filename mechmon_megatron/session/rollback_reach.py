"""Can a rollback reach back past the detector's change point? (standard library only)

An alarm comes some checks after the shift began: the CUSUM's change point (the alert's
``first_warning_step``) lies up to ``change_point_lag`` steps before the alarm's iteration. A
rollback to a checkpoint at or before the change point needs such a checkpoint to exist when the
alarm fires: the save interval ``S`` puts one at most ``S - 1`` steps before the change point, and a
retention of the last ``K`` saves keeps the saves of the last ``(K - 1) S`` steps only (the abort's
own save comes on top). This module says, before the first launch, when that cannot work.

The lag is measured, not derived: :data:`MEASURED_LAG_CHECKS` is the largest
``(alarm - change point) / interval`` over every alarm of the detector study's committed records
at the session default (docs/RESULTS.md; ``docs/data/detector_study``), and the lag in steps at a
schedule is ``checks x interval + delta - interval`` (the first check after the change point saw
the window that starts ``delta - interval`` steps before it). The planner reports it
(``mechmon-plan``: ``rollback``) and the supervisor checks a command against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DEFAULT_INTERVAL = 100
DEFAULT_DELTA = 100
"""``MechmonConfig``'s defaults (``--mechmon-interval``, ``--mechmon-delta``), repeated here so that the
supervisor needs no import beyond the standard library; a test checks they agree."""

MEASURED_LAG_CHECKS = 28
"""Largest number of checks from the CUSUM change point to its alarm on the detector study's
records (fault and healthy runs, every family, the default rate, interval 20 and 100: the dW alarm of
fa-s16-on2000-seed1 at interval 20, 560 steps after its change point; at interval 100 the most is 17);
``tests/research/study/test_rollback_lag.py`` recomputes it from the committed records."""

RETENTION_FLAGS: dict[str, str] = {
    "--keep-last-n-checkpoints": "GPT-NeoX's rolling window of the last N checkpoints",
    "--max-checkpoint-count": "keep the N newest iter_* folders",
}
"""Host flags that delete old checkpoints, keeping the last N. Megatron-LM, megatron-core's loop,
DeepSpeed and the example trainer keep every persistent checkpoint (Megatron-LM's non-persistent
checkpoints keep only the latest and live outside ``--save``: the supervisor never uses them)."""


def change_point_lag(interval: int, delta: int, checks: int = MEASURED_LAG_CHECKS) -> int:
    """Steps from the alert's ``first_warning_step`` to its alarm, at most, at this schedule
    (``interval``, ``delta``: ``--mechmon-interval`` / ``--mechmon-delta`` in steps)."""
    if interval < 1 or delta < 1:
        raise ValueError(f"--mechmon-interval and --mechmon-delta must be >= 1, got {interval} and {delta}")
    return checks * interval + max(0, delta - interval)


@dataclass(frozen=True)
class Reach:
    """What a rollback can reach at one save schedule (steps)."""

    lag: int
    """Largest change-point lag at the monitor schedule (:func:`change_point_lag`)."""
    keep_needed: int
    """Checkpoints to keep so that the newest one at or before the change point survives."""
    discarded_at_most: int
    """Steps trained and then rolled back, at most: the lag plus one save interval."""


def reach(save_interval: int, interval: int, delta: int) -> Reach:
    lag = change_point_lag(interval, delta)
    # The newest save at or before the change point is followed by at most ceil(lag / S) scheduled
    # saves before the alarm; the abort's own save may count against a retention as well.
    return Reach(lag=lag, keep_needed=math.ceil(lag / save_interval) + 2, discarded_at_most=lag + save_interval)


def reach_notice(save_interval: Optional[int], keep_last: Optional[int], keep_flag: Optional[str],
                 interval: int, delta: int) -> Optional[str]:
    """One line when the saves kept at the alarm cannot include one at or before the change
    point; None when they can (or when there is no ``--save-interval``: said elsewhere)."""
    if not save_interval or save_interval < 1 or keep_last is None:
        return None
    r = reach(save_interval, interval, delta)
    if keep_last >= r.keep_needed:
        return None
    return (f"rollback cannot reach the change point: {keep_flag} {keep_last} keeps the saves of the last "
            f"{max(0, keep_last - 1) * save_interval} steps (--save-interval {save_interval}), but the detector's "
            f"change point lies up to {r.lag} steps before its alarm at --mechmon-interval {interval} "
            f"--mechmon-delta {delta} (measured, docs/RECOVERY.md): keep at least {r.keep_needed} checkpoints"
            + (f", or save every {math.ceil(r.lag / (keep_last - 2))} steps or more" if keep_last > 2 else ""))


def missing_saves_notice(save: Optional[str], save_interval: Optional[int], interval: int,
                         delta: int) -> Optional[str]:
    """One line when a checkpoint-and-abort job keeps no checkpoint a rollback could use: no
    ``--save`` at all, or no ``--save-interval`` (the abort's own save, after the change point, is
    then the only one); None when both are set. Used by the supervisor and the Megatron-LM adapter."""
    if not save:
        return ("checkpoint-and-abort without --save: an alarm stops the job with no checkpoint to roll back to; "
                "set --save and --save-interval")
    if not save_interval or save_interval < 1:
        return (f"no --save-interval: the abort's checkpoint will be the only one, saved after the detector's change "
                f"point (up to {change_point_lag(interval, delta)} steps before the alarm at --mechmon-interval "
                f"{interval} --mechmon-delta {delta}, measured); set --save-interval so that a save lands before it")
    return None
