"""Fit the detector's null tails on healthy runs: replay without alarms, fit exponential tails.

Each healthy run is replayed with thresholds at infinity; the CUSUM value of every test at every
check (and, for the Shewhart option, every check's pooled residual) is the null distribution the
thresholds are set from. :func:`fit_levels` fits its exponential tail per family and level
(``detect.null_model.fit_null_tail``), borrowing a heavier pooled tail for a data-starved test.

A calibration at ``interval`` / ``delta`` serves two schedules (:func:`schedules`): the recorded
one (overlap ``ceil(delta / interval)``) and, when ``delta`` is a multiple of ``interval``,
``interval = delta`` (every ``delta / interval``-th check, overlap 1). :func:`calibrate_on_runs`
fits both or fails (the studies' fit); :func:`calibrate` (``mechmon-calibrate``) refuses records
that cannot fit the recorded schedule with a message naming the family, and leaves out, with a
note, a second schedule the records are too short for (a job at that schedule then uses the
recorded schedule's heavier tails, ``TailTable.tail``).

Given the runs' learning-rate schedule (``TrainingSchedule``), a calibration also measures the
phase moments of young baselines (:func:`young_residuals`, ``detect.phase_moments``) at the
recorded schedule first, and fits its tails on replays that apply them, as the session will. The
second schedule (``interval = delta``, one check in ``delta / interval``) gets no phase moments:
its young baselines span ``delta / interval`` times more steps with as many times fewer
residuals per bin (32 per dW bin from the shipped calibration's two runs), and moments that noisy
wrecked its dW tail (theta 0.78 -> 0.07); a job at that interval judges young baselines
uncorrected, and its start-up line says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from mechmon_megatron.calibrate.coverage import check_interval, family_coverage
from mechmon_megatron.calibrate.errors import CalibrationError
from mechmon_megatron.calibrate.replay import FAMILIES, Checks, never_thresholds, replay_pooled, subsample
from mechmon_megatron.detect.null_model import NullTail, TailTable, fit_null_tail
from mechmon_megatron.detect.phase_moments import PhaseTable, TrainingSchedule, fit_phase_table
from mechmon_megatron.detect.pooled_cusum import (
    PooledCusumDetector,
    SequentialConfig,
    default_sequential_config,
    trimmed_mean,
)
from mechmon_megatron.session.detector_inputs import attention_kind, observations_from_scalars

__all__ = ["TAIL_QUANTILE", "Calibration", "calibrate", "calibrate_on_runs", "fit_levels", "fit_replays",
           "fit_tail_table", "null_residuals", "null_statistics", "schedules", "young_residuals"]

TAIL_QUANTILE = 0.95
"""The tails start at the 95th percentile of the pooled values."""

OnReplay = Optional[Callable[[], None]]
"""Called after each run's replay (a progress bar's update)."""


def _tick(on_replay: OnReplay) -> None:
    if on_replay is not None:
        on_replay()


def young_residuals(
    runs: Iterable[Checks], config: SequentialConfig, on_replay: OnReplay = None
) -> dict[str, list[tuple[int, float]]]:
    """``(step, z)`` of every young baseline's uncorrected residual (``phase_corrected`` families)
    at every check of healthy runs, replayed without alarms: what the phase moments are fitted on."""
    out: dict[str, list[tuple[int, float]]] = {}
    for checks in runs:
        detector = PooledCusumDetector(never_thresholds(), config, collect_young=True)
        for step, scalars in checks:
            result = detector.update(step, observations_from_scalars(scalars))
            for family, zs in result.young_residuals.items():
                out.setdefault(family, []).extend((step, z) for z in zs)
        _tick(on_replay)
    return out


def null_statistics(
    runs: Iterable[Checks], config: SequentialConfig, on_replay: OnReplay = None,
    phase: Optional[PhaseTable] = None,
) -> dict[str, dict[str, list[float]]]:
    """CUSUM values of every test at every check of healthy runs, by family and level.

    Replayed without alarms (thresholds at infinity): the null distribution the thresholds are
    set from. Under the chosen thresholds a healthy run only differs where S exceeds the
    warning level (baselines then stop absorbing), which is the tail beyond what is fitted."""
    out: dict[str, dict[str, list[float]]] = {f: {"layer": [], "family": []} for f in FAMILIES}
    for checks in runs:
        replay = replay_pooled(checks, never_thresholds(), config, phase=phase)
        for key, series in replay.statistics.items():
            family = key.split("/", 1)[0]
            level = "layer" if "/layer_" in key else "family"
            out[family][level].extend(v for _, v in series)
        _tick(on_replay)
    return out


def null_residuals(
    runs: Iterable[Checks], config: SequentialConfig, on_replay: OnReplay = None,
    phase: Optional[PhaseTable] = None,
) -> dict[str, dict[str, list[float]]]:
    """Per-check pooled residuals of healthy runs, by family and level: ``u_L`` of every layer and
    ``u_F`` (the trimmed mean of the check's ``u_L``, as the detector pools them; families with
    more than one layer) -- the null distribution the Shewhart limits are set from. Replayed
    without alarms, like :func:`null_statistics`."""
    out: dict[str, dict[str, list[float]]] = {f: {"layer": [], "family": []} for f in FAMILIES}
    for checks in runs:
        detector = PooledCusumDetector(never_thresholds(), config, phase=phase)
        for step, scalars in checks:
            result = detector.update(step, observations_from_scalars(scalars))
            per_family: dict[str, list[float]] = {}
            for key, value in result.statistics.items():
                if "/residual/layer_" in key:
                    per_family.setdefault(key.split("/", 1)[0], []).append(value)
            for family, us in per_family.items():
                out[family]["layer"].extend(us)
                if len(us) > 1:
                    out[family]["family"].append(trimmed_mean(us, config.trim))
        _tick(on_replay)
    return out


def fit_levels(
    stats: Mapping[str, Mapping[str, list[float]]], overlap: int, tail_quantile: float, what: str,
    fit: Callable[..., NullTail] = fit_null_tail,
) -> tuple[dict[str, dict[str, NullTail]], dict[str, Any]]:
    """Fit every family and level of ``stats`` (``null_statistics`` or ``null_residuals``), with the
    borrowing of a data-starved test; ``what`` names the statistic in the error. ``fit`` is the
    tail fit (``null_model.fit_null_tail``; research variants pass their own)."""
    tails: dict[str, dict[str, NullTail]] = {}
    log: dict[str, Any] = {}
    pooled = {level: [v for levels in stats.values() for v in levels[level]] for level in ("layer", "family")}
    for level in ("layer", "family"):
        for family, levels in stats.items():
            values = levels[level]
            if not values:
                continue
            entry: dict[str, Any] = {
                "values": len(values),
                "max_value": max(values),
                "zeros": sum(1 for v in values if v <= 0),
            }
            # Too few excursions to fit (a quiet test): fall back to a tail that is at least as
            # heavy: all families at this level together, then (family level) the layer tail.
            candidates = [(values, ""), (pooled[level], f"the {level} tail of all families pooled")]
            if level == "family":
                candidates += [
                    (levels["layer"], "this family's layer tail"),
                    (pooled["layer"], "the layer tail of all families pooled"),
                ]
            for data, note in candidates:
                try:
                    tail = fit(data, tail_quantile=tail_quantile)
                except ValueError:
                    continue
                if note:
                    entry["fallback"] = f"too few excursions; used {note}"
                break
            else:
                prefix = "" if what == "CUSUM" else f"{what} "
                raise ValueError(
                    f"overlap {overlap}: no healthy excursions to fit {prefix}{family}/{level}; record longer runs"
                )
            tails.setdefault(family, {})[level] = tail
            log[f"{overlap}/{family}/{level}"] = {**entry, **tail.to_dict()}
    return tails, log


def fit_tail_table(
    overlaps: Mapping[int, tuple[int, Sequence[Checks]]],
    source: str = "",
    tail_quantile: float = TAIL_QUANTILE,
    shewhart: bool = False,
    on_replay: OnReplay = None,
    delta: Optional[int] = None,
    schedule: Optional[TrainingSchedule] = None,
    phase_intervals: Sequence[int] = (),
) -> tuple[TailTable, dict[str, Any]]:
    """Null tails per overlap; ``overlaps``: overlap -> (check interval, healthy check series).
    Each overlap's series is replayed with the shipped design for its interval. ``shewhart``:
    also fit the tails of the per-check pooled residuals (the Shewhart limits' null model).
    ``delta`` and ``schedule`` (the runs' window and learning-rate schedule) both given: at each
    check interval of ``phase_intervals`` first fit the phase moments (of the runs' attention
    kind), then the tails on replays that apply them."""
    tails: dict[int, dict[str, dict[str, NullTail]]] = {}
    log: dict[str, Any] = {}
    shewhart_tails: dict[int, dict[str, dict[str, NullTail]]] = {}
    phases: list[PhaseTable] = []
    for overlap, (interval, series) in overlaps.items():
        config = default_sequential_config(interval)
        phase = None
        if delta is not None and schedule is not None and interval in phase_intervals:
            phase = fit_phase_table(young_residuals(series, config, on_replay), interval, delta, schedule,
                                    attention=attention_kind(c for run in series for c in run))
            phases.append(phase)
            log[f"phase/{overlap}"] = phase.to_dict()
        tails[overlap], fit_log = fit_levels(null_statistics(series, config, on_replay, phase), overlap,
                                             tail_quantile, "CUSUM")
        log.update(fit_log)
        if shewhart:
            shewhart_tails[overlap], fit_log = fit_levels(
                null_residuals(series, config, on_replay, phase), overlap, tail_quantile, "residual"
            )
            log.update({f"shewhart/{k}": v for k, v in fit_log.items()})
    return TailTable(tails=tails, source=source, shewhart=shewhart_tails, phase=tuple(phases)), log


def calibrate_on_runs(
    series: Sequence[Checks], interval: int, delta: int, source: str = "", shewhart: bool = False,
    on_replay: OnReplay = None, schedule: Optional[TrainingSchedule] = None,
) -> tuple[TailTable, dict[str, Any]]:
    """Null tails of healthy runs recorded every ``interval`` steps over ``delta``-step windows: at
    their own overlap ``ceil(delta / interval)`` and, when ``delta`` is a multiple of ``interval``,
    at overlap 1 (every ``delta / interval``-th check: the schedule ``interval = delta``).
    ``schedule``: the runs' learning-rate schedule; given, the phase moments are fitted too (at the
    recorded interval only)."""
    if interval < 1 or delta < 1:
        raise ValueError(f"interval and delta must be >= 1, got {interval}, {delta}.")
    native = math.ceil(delta / interval)
    overlaps: dict[int, tuple[int, Sequence[Checks]]] = {native: (interval, series)}
    if native > 1 and delta % interval == 0:
        overlaps[1] = (delta, [subsample(c, interval, native) for c in series])
    return fit_tail_table(overlaps, source=source, shewhart=shewhart, on_replay=on_replay, delta=delta,
                          schedule=schedule, phase_intervals=(interval,))


def schedules(interval: int, delta: int) -> list[tuple[int, int, int]]:
    """``(interval, overlap, every)`` of each schedule a calibration at ``interval`` / ``delta``
    serves: the recorded one, and ``interval = delta`` when ``delta`` is a multiple of it."""
    if interval < 1 or delta < 1:
        raise ValueError(f"interval and delta must be >= 1, got {interval}, {delta}")
    native = math.ceil(delta / interval)
    out = [(interval, native, 1)]
    if native > 1 and delta % interval == 0:
        out.append((delta, 1, native))
    return out


def fit_replays(runs: int, interval: int, delta: int, shewhart: bool = True, phase: bool = False) -> int:
    """How many run replays :func:`calibrate` makes at most (its progress total)."""
    return runs * ((1 + shewhart) * len(schedules(interval, delta)) + phase)


@dataclass(frozen=True, slots=True)
class Calibration:
    """What :func:`calibrate` fitted."""

    table: TailTable
    """The null tails (and Shewhart tails) per overlap: what ``--mechmon-detector-calibration`` reads."""
    log: dict[str, Any]
    """Per ``"<overlap>/<family>/<level>"`` (and ``"shewhart/..."``): values, zeros, the fitted tail."""
    notes: tuple[str, ...] = ()
    """A schedule left out, and why (one line each)."""


def calibrate(series: Sequence[Checks], names: Sequence[str], interval: int, delta: int, source: str = "",
              on_replay: OnReplay = None, schedule: Optional[TrainingSchedule] = None) -> Calibration:
    """Null tails (with the Shewhart section) of healthy runs named ``names``, recorded every
    ``interval`` steps over ``delta``-step windows, at each schedule of :func:`schedules`.

    :class:`CalibrationError` for runs recorded at another interval, and for records that cannot
    fit a family at the recorded schedule (the message names the family and the checks it needs
    against those the runs have); a second schedule they cannot fit is left out with a note. When
    every schedule fits, the table and log equal those of ``calibrate_on_runs(..., shewhart=True)``.
    ``schedule`` (the runs' learning-rate schedule) given: the recorded schedule's phase moments too."""
    check_interval(series, names, interval)
    tails: dict[int, dict[str, dict[str, NullTail]]] = {}
    shewhart: dict[int, dict[str, dict[str, NullTail]]] = {}
    phases: list[PhaseTable] = []
    log: dict[str, Any] = {}
    notes: list[str] = []
    native_interval, native_overlap, _ = schedules(interval, delta)[0]
    for sched_interval, overlap, every in schedules(interval, delta):
        runs = series if every == 1 else [subsample(c, interval, every) for c in series]
        try:
            table, fit_log = _fit_schedule(runs, names, interval, every, overlap, source, on_replay, delta, schedule)
        except CalibrationError as exc:
            if every == 1:
                raise
            notes.append(f"no tails for --mechmon-interval {sched_interval} (one check in {every}): {exc}; a job "
                         f"at that interval uses the interval {native_interval} tails (overlap {native_overlap}, "
                         "heavier: conservative)")
            continue
        tails.update(table.tails)
        shewhart.update(table.shewhart)
        phases.extend(table.phase)
        log.update(fit_log)
    return Calibration(table=TailTable(tails=tails, source=source, shewhart=shewhart, phase=tuple(phases)), log=log,
                       notes=tuple(notes))


def _fit_schedule(runs: Sequence[Checks], names: Sequence[str], interval: int, every: int, overlap: int,
                  source: str, on_replay: OnReplay, delta: int,
                  schedule: Optional[TrainingSchedule]) -> tuple[TailTable, dict[str, Any]]:
    """One schedule's tails, or a :class:`CalibrationError` naming the family that cannot be fitted.
    The coverage is checked before the replays (a short record fails at once), the table after."""
    sched_interval = interval * every
    coverage = family_coverage(runs, names, sched_interval)
    short = sorted((c for c in coverage.values() if c.short), key=lambda c: c.family)
    if short:
        raise CalibrationError(short[0].message(sched_interval))
    try:
        table, log = fit_tail_table({overlap: (sched_interval, runs)}, source=source, shewhart=True,
                                    on_replay=on_replay, delta=delta, schedule=schedule, phase_intervals=(interval,))
    except ValueError as exc:
        longest = max((len(r) for r in runs), default=0)
        raise CalibrationError(f"{exc} (interval {sched_interval}: the longest run has {longest} checks)") from None
    missing = sorted(set(coverage) - set(table.tails.get(overlap, {})))
    if missing:  # the coverage said enough checks, yet no statistic (values that never formed a baseline)
        raise CalibrationError(f"detector family {missing[0]!r} has no healthy statistics to fit at interval "
                               f"{sched_interval}: its values never formed a baseline; record longer healthy runs")
    return table, log
