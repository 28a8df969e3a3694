"""Replay the online whole-job detector over the scanned series, check by check.

The detector is the session's (``session/detector_setup.py``): a
:class:`~mechmon_megatron.detect.pooled_cusum.PooledCusumDetector` with the design
``default_sequential_config(interval)`` and thresholds from ``--false-alarm-rate`` through the
null tails (shipped or ``--detector-calibration``) and the union bound over the scan's tests, as
if the run had been monitored online with ``--mechmon-interval`` = the check interval and
``--mechmon-delta`` = the window (docs/SCAN.md, "Detector"). Families: ``attn_delta2``,
``attn_dw`` and, for MoE layers, ``router_weights`` (``router_entropy`` needs tokens).

An anomaly is reported as the interval ``(after_iteration, before_iteration]``: the detector
fired at the check of ``before_iteration``; the CUSUM's last zero before it is its estimate of
the change point, so the shift began after ``after_iteration``, the earlier checkpoint of the
first pair after that zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from mechmon_megatron.detect.pooled_cusum import PooledAlarm
from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.pairs import PairRecord
from mechmon_megatron.scan.schedule import ScanPlan
from mechmon_megatron.session import names
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.detector_inputs import observation
from mechmon_megatron.session.detector_setup import alert_of, build_detector, job_shape, load_detector_design

__all__ = ["Anomaly", "CheckValues", "ReplayResult", "replay"]


@dataclass(kw_only=True, frozen=True)
class Anomaly:
    """One fired alarm, located in checkpoint iterations."""

    after_iteration: int
    before_iteration: int
    family: str
    layer: Optional[int]
    heads: list[int]
    level: str
    kind: str
    layers: list[int]
    statistic: float
    threshold: Optional[float]
    reason: str

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for key in ("statistic", "threshold"):
            value = out[key]
            out[key] = None if value is None or not math.isfinite(value) else value
        return out

    def sentence(self) -> str:
        heads = f", heads {', '.join(str(h) for h in self.heads)}" if self.heads else ""
        where = f"layer {self.layer}" if self.layer is not None else "the model"
        if self.level == "family" and len(self.layers) > 1:
            where += f" (family test over layers {', '.join(str(L) for L in self.layers)})"
        return (f"first anomaly between iteration {self.after_iteration} and {self.before_iteration}: "
                f"{self.family}, {where}{heads}")


@dataclass
class CheckValues:
    """Everything one check writes: the monitors' scalars and the detector's statistics."""

    step: int
    earlier: int
    scalars: dict[str, float] = field(default_factory=dict)


@dataclass
class ReplayResult:
    checks: list[CheckValues]
    anomalies: list[Anomaly]
    thresholds: dict[str, Any]

    @property
    def first_anomaly(self) -> Optional[Anomaly]:
        return self.anomalies[0] if self.anomalies else None


def session_config(plan: ScanPlan, false_alarm_rate: float, calibration: Optional[str]) -> MechmonConfig:
    """The online configuration this scan stands in for (interval, delta, rate, calibration)."""
    return MechmonConfig(enabled=True, interval=plan.interval, delta=plan.delta, false_alarm_rate=false_alarm_rate,
                         detector_calibration=calibration, per_head_scalars=True)


def _after_iteration(alarm: PooledAlarm, plan: ScanPlan) -> int:
    """The earlier checkpoint of the first judged pair after the CUSUM's last zero."""
    checks = [plan.iterations(p) for p in plan.pairs]
    if alarm.kind == "cusum":
        later = [c for c in checks if alarm.change_step is None or c[1] > alarm.change_step]
        if later:
            return later[0][0]
    return next(c[0] for c in checks if c[1] == alarm.step)


def replay(
    plan: ScanPlan, records: Mapping[int, Sequence[PairRecord]], attn_layers: Sequence[int],
    router_layers: Sequence[int], false_alarm_rate: float, calibration: Optional[str],
) -> ReplayResult:
    """``records``: check step (later iteration) -> every layer's record of that pair."""
    config = session_config(plan, false_alarm_rate, calibration)
    try:
        design, table = load_detector_design(config)
    except ValueError as exc:
        raise ScanInputError(str(exc).replace("--mechmon-detector-calibration", "--detector-calibration")) from None
    shape = {"attn_delta2": list(attn_layers), "attn_dw": list(attn_layers)}
    if router_layers:
        shape["router_weights"] = list(router_layers)
    detector, account = build_detector(config, job_shape(config, [shape]), design, table)
    account["design"] = {"warmup_checks": design.trend.warmup, "baseline_window_checks": design.trend.window,
                         "reference": design.reference, "interval_steps": plan.interval, "delta_steps": plan.delta}
    checks: list[CheckValues] = []
    anomalies: list[Anomaly] = []
    for pair in plan.pairs:
        earlier, step = plan.iterations(pair)
        layer_records = sorted(records.get(step, ()), key=lambda r: r.layer)
        values = CheckValues(step=step, earlier=earlier)
        for record in layer_records:
            values.scalars.update(record.scalars)
            for message in record.nonfinite:
                anomalies.append(Anomaly(after_iteration=earlier, before_iteration=step, family="nonfinite",
                                         layer=record.layer, heads=[], level="layer", kind="nonfinite",
                                         layers=[record.layer], statistic=math.nan, threshold=None, reason=message))
        observations = [
            obs for record in layer_records for stream in record.stream_records()
            if (obs := observation(stream.name, stream.value, stream.limit, stream.limit_reason)) is not None
        ]
        result = detector.update(step, observations)
        for alarm in result.alarms:
            alert = alert_of(alarm, config, design)
            anomalies.append(Anomaly(
                after_iteration=_after_iteration(alarm, plan), before_iteration=step, family=alarm.family,
                layer=alert.layer, heads=list(alert.heads), level=alarm.level, kind=alarm.kind,
                layers=list(alarm.layers), statistic=alarm.statistic, threshold=alarm.threshold,
                reason=alert.reason.replace("--mechmon-false-alarm-rate", "--false-alarm-rate"),
            ))
        values.scalars.update({f"{names.DETECT_PREFIX}/{k}": v for k, v in result.statistics.items()})
        values.scalars[names.ALARM] = 1.0 if any(a.before_iteration == step for a in anomalies) else 0.0
        values.scalars[names.WARNINGS] = float(len(result.warnings))
        checks.append(values)
    anomalies.sort(key=lambda a: (a.before_iteration, a.after_iteration))
    return ReplayResult(checks=checks, anomalies=anomalies, thresholds=account)
