"""Does a calibration hold on a healthy run it has not seen? Leave one run out.

For each healthy run: fit the null tails on the other runs exactly as ``mechmon-calibrate`` does
(``fit.fit_levels`` on their CUSUM values), set the thresholds of the rate R for the held-out
run's own shape, and replay the detector on it. A held-out alarm is a false alarm that a job
calibrated on the others would have raised; the closest approach (largest CUSUM against the
warning level) says how much room the quiet ones had. Both schedules that a calibration file
serves are checked: the recorded one (overlap ``ceil(delta / interval)``) and, when ``delta`` is a
multiple of ``interval``, ``interval = delta`` (every ``delta / interval``-th check, overlap 1).

The null statistics are computed once per run and pooled per fold (the fit only pools them), so a
check of N runs costs about 2N replays per schedule. With the runs' learning-rate schedule, each
fold also fits its own phase moments on its runs (``detect.phase_moments``), and its null
statistics come from replays that apply them: N (the young residuals) + N (N - 1) + N replays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from mechmon_megatron.calibrate.fit import TAIL_QUANTILE, fit_levels, null_statistics, schedules, young_residuals
from mechmon_megatron.calibrate.replay import Checks, FamilyMargin, closest_margin, replay_healthy, subsample
from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, NullTail, TailTable
from mechmon_megatron.detect.phase_moments import TrainingSchedule, fit_phase_table
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.session.detector_inputs import attention_kind

__all__ = ["FoldFit", "HeldOutRun", "leave_one_run_out", "pool_statistics", "replays_needed", "shipped_fold_fit",
           "summary"]


@dataclass(frozen=True, slots=True)
class HeldOutRun:
    """One run replayed with the tails of the others."""

    run: str
    interval: int
    overlap: int
    fitted_on: tuple[str, ...]
    alarms: tuple[dict[str, Any], ...]
    """As ``DetectorReplay.alarms``: step, family, level, layers, statistic, threshold, change_step."""
    closest_family: str
    closest: FamilyMargin
    """The layer-level test that came closest to (or past) its warning level."""
    misfits: tuple[tuple[int, str], ...] = ()
    """(step, family) where the session's calibration misfit counter would have fired."""


def pool_statistics(stats: Sequence[Mapping[str, Mapping[str, list[float]]]]) -> dict[str, dict[str, list[float]]]:
    """The null statistics of several runs (``fit.null_statistics`` of each) as one."""
    out: dict[str, dict[str, list[float]]] = {}
    for s in stats:
        for family, levels in s.items():
            for level, values in levels.items():
                out.setdefault(family, {}).setdefault(level, []).extend(values)
    return out


def replays_needed(runs: int, interval: int, delta: int, phase: bool = False) -> int:
    """How many detector replays :func:`leave_one_run_out` makes (its progress total): with
    ``phase``, the recorded schedule's folds refit their phase moments (N + N (N - 1) + N)."""
    n_schedules = len(schedules(interval, delta))
    return 2 * runs * n_schedules + (runs * (runs - 1) if phase else 0)


FoldFit = Callable[[Sequence[Checks], Sequence[Mapping[str, Mapping[str, list[float]]]], int, int],
                   dict[str, dict[str, NullTail]]]
"""(the fold's runs at the schedule, their null statistics, check interval, overlap) -> tails."""


def shipped_fold_fit(runs: Sequence[Checks], stats: Sequence[Mapping[str, Mapping[str, list[float]]]],
                     interval: int, overlap: int) -> dict[str, dict[str, NullTail]]:
    """The fit ``mechmon-calibrate`` makes: the exponential tail of the pooled values."""
    tails, _ = fit_levels(pool_statistics(stats), overlap, TAIL_QUANTILE, "CUSUM")
    return tails


def leave_one_run_out(series: Sequence[Checks], names: Sequence[str], interval: int, delta: int,
                      rate: float = DEFAULT_FALSE_ALARM_RATE,
                      on_replay: Optional[Callable[[], None]] = None,
                      fold_fit: FoldFit = shipped_fold_fit,
                      schedule: Optional[TrainingSchedule] = None) -> list[HeldOutRun]:
    """Every run of ``series`` (checks recorded every ``interval`` steps over ``delta``-step
    windows, named by ``names``) against the tails of the others, at each schedule of
    :func:`~mechmon_megatron.calibrate.fit.schedules`. ``on_replay`` is called after each detector
    replay (a progress bar: :func:`replays_needed` calls in all). ``ValueError`` for fewer than
    three runs (two to fit, one to hold out) or when the others have too few excursions to fit a
    family (the message names it). ``fold_fit`` fits a fold's tails (research variants of the fit
    pass their own). ``schedule``: the runs' learning-rate schedule; given, each fold fits and
    applies its own phase moments, as ``mechmon-calibrate`` with that schedule would."""
    if len(series) != len(names):
        raise ValueError(f"{len(series)} runs but {len(names)} names")
    if len(series) < 3:
        raise ValueError(f"leave-one-run-out needs at least 3 healthy runs, got {len(series)}")
    out = []
    for sched_interval, overlap, every in schedules(interval, delta):
        runs = [subsample(c, interval, every) for c in series]
        config = default_sequential_config(sched_interval)
        tick = on_replay or (lambda: None)
        per_run = []
        young = []
        for c in runs:
            if schedule is None or every > 1:
                per_run.append(null_statistics([c], config))
            else:
                young.append(young_residuals([c], config))
            tick()
        for i, held in enumerate(runs):
            others = [names[j] for j in range(len(runs)) if j != i]
            train = [j for j in range(len(runs)) if j != i]
            phase = None
            if schedule is None or every > 1:  # phase moments at the recorded interval only (calibrate.fit)
                stats = [per_run[j] for j in train]
            else:
                pooled = {f: [p for j in train for p in young[j].get(f, [])] for f in {f for y in young for f in y}}
                phase = fit_phase_table(pooled, sched_interval, delta, schedule,
                                        attention=attention_kind(c for j in train for c in runs[j]))
                stats = []
                for j in train:
                    stats.append(null_statistics([runs[j]], config, phase=phase))
                    tick()
            tails = fold_fit([runs[j] for j in train], stats, sched_interval, overlap)
            table = TailTable(tails={overlap: tails}, source=f"healthy runs {', '.join(others)}",
                              phase=() if phase is None else (phase,))
            replay = replay_healthy(held, sched_interval, overlap, table, names[i], rate, phase=phase)
            tick()
            family, margin = closest_margin(replay)
            out.append(HeldOutRun(run=names[i], interval=sched_interval, overlap=overlap, fitted_on=tuple(others),
                                  alarms=tuple(replay.alarms), closest_family=family, closest=margin,
                                  misfits=tuple((int(m[0]), str(m[1])) for m in replay.misfits)))
    return out


def summary(checks: Sequence[HeldOutRun]) -> dict[str, Any]:
    """Per schedule: held-out runs, those with an alarm, those whose misfit counter fired first
    (before their first alarm, or with none), and the smallest room under a warning level
    (warning / largest: below 1 means the warning was crossed)."""
    out: dict[str, Any] = {}
    for c in checks:
        entry = out.setdefault(f"interval {c.interval}",
                               {"runs": 0, "with_alarm": [], "misfit_first": [], "least_room": None})
        entry["runs"] += 1
        if c.alarms:
            entry["with_alarm"].append(c.run)
        if c.misfits and (not c.alarms or c.misfits[0][0] < c.alarms[0]["step"]):
            entry["misfit_first"].append(c.run)
        room = c.closest.warning / c.closest.largest if c.closest.largest > 0 else math.inf
        if entry["least_room"] is None or room < entry["least_room"]["warning_over_largest"]:
            entry["least_room"] = {"run": c.run, "family": c.closest_family, "layer": c.closest.layer,
                                   "largest": c.closest.largest, "warning": c.closest.warning,
                                   "warning_over_largest": room}
    return out
