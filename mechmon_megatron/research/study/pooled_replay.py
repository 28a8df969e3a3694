"""Replay the whole-job detector on recorded runs: first alarms, null statistics, calibration.

A run's ``mechmon_scalars.jsonl`` holds one row per check; replaying it through
:class:`~mechmon_megatron.detect.pooled_cusum.PooledCusumDetector` with the inputs of
:mod:`mechmon_megatron.session.detector_inputs` reproduces the online decisions. ``every``
keeps one check in ``every`` (checks at multiples of ``every * interval``): a run recorded at
interval 20 with delta 100 replays as interval 100 with delta 100 (non-overlapping windows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from mechmon_megatron.detect.null_model import JobShape, NullTail, TailTable, fit_null_tail, thresholds_for_job
from mechmon_megatron.detect.pooled_cusum import (
    FAMILY_DIRECTIONS,
    OPTIONAL_FAMILIES,
    FamilyThresholds,
    PooledAlarm,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
    default_sequential_config,
    trimmed_mean,
)
from mechmon_megatron.session.detector_inputs import observations_from_scalars

Checks = Sequence[tuple[int, Mapping[str, float]]]
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
) -> PooledReplay:
    """Feed every check to a fresh detector; alarms before ``start_step`` are kept but flagged by
    the caller (the detector sees the whole run either way). ``warning_probability`` (the per-test
    probability of the warning level, as the session passes it) turns the misfit counter on."""
    detector = PooledCusumDetector(thresholds, config, warning_probability=warning_probability)
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
    return {f: FamilyThresholds(layer=_NEVER, family=_NEVER) for f in FAMILIES}


def null_statistics(
    runs: Iterable[Checks], config: SequentialConfig
) -> dict[str, dict[str, list[float]]]:
    """CUSUM values of every test at every check of healthy runs, by family and level.

    Replayed without alarms (thresholds at infinity): the null distribution the thresholds are
    set from. Under the chosen thresholds a healthy run only differs where S exceeds the
    warning level (baselines then stop absorbing), which is the tail beyond what is fitted."""
    out: dict[str, dict[str, list[float]]] = {f: {"layer": [], "family": []} for f in FAMILIES}
    for checks in runs:
        replay = replay_pooled(checks, never_thresholds(), config)
        for key, series in replay.statistics.items():
            family = key.split("/", 1)[0]
            level = "layer" if "/layer_" in key else "family"
            out[family][level].extend(v for _, v in series)
    return out


def null_residuals(
    runs: Iterable[Checks], config: SequentialConfig
) -> dict[str, dict[str, list[float]]]:
    """Per-check pooled residuals of healthy runs, by family and level: ``u_L`` of every layer and
    ``u_F`` (the trimmed mean of the check's ``u_L``, as the detector pools them; families with
    more than one layer) -- the null distribution the Shewhart limits are set from. Replayed
    without alarms, like :func:`null_statistics`."""
    out: dict[str, dict[str, list[float]]] = {f: {"layer": [], "family": []} for f in FAMILIES}
    for checks in runs:
        detector = PooledCusumDetector(never_thresholds(), config)
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
    tail_quantile: float = 0.95,
    shewhart: bool = False,
) -> tuple[TailTable, dict[str, Any]]:
    """Null tails per overlap; ``overlaps``: overlap -> (check interval, healthy check series).
    Each overlap's series is replayed with the shipped design for its interval. ``shewhart``:
    also fit the tails of the per-check pooled residuals (the Shewhart limits' null model)."""
    tails: dict[int, dict[str, dict[str, NullTail]]] = {}
    log: dict[str, Any] = {}
    shewhart_tails: dict[int, dict[str, dict[str, NullTail]]] = {}
    for overlap, (interval, series) in overlaps.items():
        config = default_sequential_config(interval)
        tails[overlap], fit_log = fit_levels(null_statistics(series, config), overlap, tail_quantile, "CUSUM")
        log.update(fit_log)
        if shewhart:
            shewhart_tails[overlap], fit_log = fit_levels(
                null_residuals(series, config), overlap, tail_quantile, "residual"
            )
            log.update({f"shewhart/{k}": v for k, v in fit_log.items()})
    return TailTable(tails=tails, source=source, shewhart=shewhart_tails), log


def calibrate_on_runs(
    series: Sequence[Checks], interval: int, delta: int, source: str = "", shewhart: bool = False
) -> tuple[TailTable, dict[str, Any]]:
    """Null tails of healthy runs recorded every ``interval`` steps over ``delta``-step windows: at
    their own overlap ``ceil(delta / interval)`` and, when ``delta`` is a multiple of ``interval``,
    at overlap 1 (every ``delta / interval``-th check: the schedule ``interval = delta``)."""
    if interval < 1 or delta < 1:
        raise ValueError(f"interval and delta must be >= 1, got {interval}, {delta}.")
    native = math.ceil(delta / interval)
    overlaps: dict[int, tuple[int, Sequence[Checks]]] = {native: (interval, series)}
    if native > 1 and delta % interval == 0:
        overlaps[1] = (delta, [subsample(c, interval, native) for c in series])
    return fit_tail_table(overlaps, source=source, shewhart=shewhart)


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
) -> tuple[dict[str, FamilyThresholds], dict[str, Any]]:
    return thresholds_for_job(proxy_shape(checks, interval, overlap), rate, table, shewhart=shewhart)
