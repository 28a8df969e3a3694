"""Replay the whole-job detector on recorded checks: alarms, CUSUM statistics, margins.

A run's ``mechmon_scalars.jsonl`` holds one row per check; replaying it through
:class:`~mechmon_megatron.detect.pooled_cusum.PooledCusumDetector` with the inputs of
:mod:`mechmon_megatron.session.detector_inputs` reproduces the online decisions. ``every``
keeps one check in ``every`` (checks at multiples of ``every * interval``): a run recorded at
interval 20 with delta 100 replays as interval 100 with delta 100 (non-overlapping windows).

:func:`replay_healthy` replays one run under the thresholds of a tail table at a false-alarm
rate and reports, per family, how close its CUSUMs came to their warning and alarm levels (the
held-out side of the leave-one-run-out check).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from mechmon_megatron.detect.null_model import (
    DEFAULT_FALSE_ALARM_RATE,
    JobShape,
    TailTable,
    ThresholdAccount,
    thresholds_for_job,
)
from mechmon_megatron.detect.phase_moments import PhaseTable
from mechmon_megatron.detect.pooled_cusum import (
    FAMILY_DIRECTIONS,
    OPTIONAL_FAMILIES,
    FamilyThresholds,
    PooledAlarm,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
    default_sequential_config,
)
from mechmon_megatron.session.detector_inputs import observations_from_scalars

__all__ = [
    "CORE_FAMILIES", "FAMILIES", "Checks", "DetectorReplay", "FamilyMargin", "PooledReplay", "closest_margin",
    "never_thresholds", "proxy_shape", "replay_healthy", "replay_pooled", "subsample", "thresholds_at_rate",
]

Checks = Sequence[tuple[int, Mapping[str, float]]]
"""One run's checks: ``(step, {scalar name: value})`` sorted by step (repeats of a resume kept)."""
FAMILIES: tuple[str, ...] = tuple(FAMILY_DIRECTIONS)
CORE_FAMILIES: tuple[str, ...] = tuple(f for f in FAMILY_DIRECTIONS if f not in OPTIONAL_FAMILIES)
"""The families every recorded run has (the tables of the detector study); ``FAMILIES`` adds the
optional ones (``attn_delta2_short``), which a replay judges when a record holds them."""
_NEVER = Thresholds(warning=1e12, alarm=1e12)


def subsample(checks: Checks, interval: int, every: int) -> list[tuple[int, Mapping[str, float]]]:
    """Checks at multiples of ``every * interval`` (all of them for ``every == 1``)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}.")
    return [(s, sc) for s, sc in checks if s % (interval * every) == 0]


@dataclass
class PooledReplay:
    first_alarm: dict[str, Optional[int]]
    alarms: list[PooledAlarm] = field(default_factory=list)
    statistics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """``"<family>/cusum/layer_L"`` and ``"<family>/cusum"`` -> [(step, S)]."""
    misfits: list[tuple[int, str]] = field(default_factory=list)
    """(step, family) where the calibration misfit counter fired (with ``warning_probability``)."""


def replay_pooled(
    checks: Checks,
    thresholds: Mapping[str, FamilyThresholds],
    config: SequentialConfig,
    start_step: int = 0,
    warning_probability: Optional[float] = None,
    phase: Optional[PhaseTable] = None,
) -> PooledReplay:
    """Feed every check to a fresh detector; alarms before ``start_step`` are kept but flagged by
    the caller (the detector sees the whole run either way). ``warning_probability`` (the per-test
    probability of the warning level, as the session passes it) turns the misfit counter on;
    ``phase``: the early-phase correction (``detect.phase_moments``), as the session passes it."""
    detector = PooledCusumDetector(thresholds, config, warning_probability=warning_probability, phase=phase)
    out = PooledReplay(first_alarm={f: None for f in FAMILIES})
    for step, scalars in checks:
        result = detector.update(step, observations_from_scalars(scalars))
        out.misfits += [(step, family) for family in result.misfits]
        for key, value in result.statistics.items():
            if "/cusum" in key:
                out.statistics.setdefault(key, []).append((step, value))
        for alarm in result.alarms:
            out.alarms.append(alarm)
            if step >= start_step and out.first_alarm[alarm.family] is None:
                out.first_alarm[alarm.family] = step
    return out


def never_thresholds() -> dict[str, FamilyThresholds]:
    """Levels no healthy CUSUM reaches: a replay under them raises no CUSUM alarm."""
    return {f: FamilyThresholds(layer=_NEVER, family=_NEVER) for f in FAMILIES}


def proxy_shape(checks: Checks, interval: int, overlap: int) -> JobShape:
    """The job shape of a recorded run: layers per family seen in any of its checks (a check
    right after a resume has no attention values)."""
    layers: dict[str, set[int]] = {f: set() for f in FAMILIES}
    for _, scalars in checks:
        for obs in observations_from_scalars(scalars):
            layers[obs.family].add(obs.layer)
    return JobShape(layers={f: len(v) for f, v in layers.items() if v}, interval=interval, overlap=overlap)


def thresholds_at_rate(
    checks: Checks, interval: int, overlap: int, rate: float, table: TailTable, shewhart: bool = False
) -> tuple[dict[str, FamilyThresholds], ThresholdAccount]:
    """The thresholds (and their account) a job of this run's shape would get at ``rate`` false
    alarms per 10^6 steps from ``table``."""
    return thresholds_for_job(proxy_shape(checks, interval, overlap), rate, table, shewhart=shewhart)


@dataclass(frozen=True, slots=True)
class FamilyMargin:
    """Largest CUSUM of one family's tests over a run, against the levels (CUSUM units)."""

    level: str
    """``layer`` (the largest over its layers) or ``family`` (the pooled test)."""
    largest: float
    layer: Optional[int]
    """The layer that reached ``largest`` (layer level only)."""
    step: int
    warning: float
    alarm: float


@dataclass
class DetectorReplay:
    """One run under the detector at one schedule (its alarms and its families' margins)."""

    run_id: str
    interval: int
    steps: int
    alarms: list[dict[str, Any]] = field(default_factory=list)
    """Each: step, family, level, layers, statistic, threshold, change_step."""
    margins: dict[str, list[FamilyMargin]] = field(default_factory=dict)
    misfits: list[list[Any]] = field(default_factory=list)
    """[step, family] where the calibration misfit counter fired, as the session's would."""


def replay_healthy(checks: Checks, interval: int, overlap: int, table: TailTable, run_id: str = "",
                   rate: float = DEFAULT_FALSE_ALARM_RATE, phase: Optional[PhaseTable] = None) -> DetectorReplay:
    """The detector with ``table``'s thresholds at ``rate`` on one run's ``checks`` (already at
    ``interval``, families the table covers only), its misfit counter on as in the session: its
    alarms, misfits and every family's margins. ``phase``: the early-phase correction the session
    would apply (one of ``table.phase``, ``detect.phase_moments.select_phase_table``)."""
    thresholds, account = thresholds_at_rate(checks, interval, overlap, rate, table)
    replay = replay_pooled(checks, thresholds, default_sequential_config(interval),
                           warning_probability=account.warning_per_test_check_probability, phase=phase)
    out = DetectorReplay(run_id=run_id, interval=interval, steps=checks[-1][0] if checks else 0,
                         misfits=[list(m) for m in replay.misfits])
    out.alarms = [{"step": a.step, "family": a.family, "level": a.level, "layers": list(a.layers),
                   "statistic": a.statistic, "threshold": a.threshold, "change_step": a.change_step}
                  for a in replay.alarms]
    for family, levels in thresholds.items():
        for level in ("layer", "family"):
            keys = [k for k in replay.statistics if k.split("/", 1)[0] == family
                    and (("/layer_" in k) == (level == "layer"))]
            if not keys:
                continue
            best = max(((v, s, k) for k in keys for s, v in replay.statistics[k]), key=lambda t: t[0])
            layer = int(best[2].rsplit("_", 1)[1]) if level == "layer" else None
            t = getattr(levels, level)
            out.margins.setdefault(family, []).append(
                FamilyMargin(level=level, largest=best[0], layer=layer, step=best[1], warning=t.warning,
                             alarm=t.alarm))
    return out


def closest_margin(replay: DetectorReplay) -> tuple[str, FamilyMargin]:
    """The family and layer-level margin whose largest CUSUM came closest to (or past) its warning."""
    return max(((f, m) for f, ms in replay.margins.items() for m in ms if m.level == "layer"),
               key=lambda fm: fm[1].largest / fm[1].warning)
