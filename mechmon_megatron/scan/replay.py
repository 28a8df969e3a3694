"""Replay the online whole-job detector over the scanned series, check by check.

The detector is the session's (``session/detector_setup.py``): a
:class:`~mechmon_megatron.detect.pooled_cusum.PooledCusumDetector` with the design
``default_sequential_config(interval)`` and thresholds from ``--false-alarm-rate`` through the
null tails (shipped or ``--detector-calibration``) and the union bound over the scan's tests, as
if the run had been monitored online with ``--mechmon-interval`` = the check interval and
``--mechmon-delta`` = the window (docs/SCAN.md, "Detector"). Families: those a checkpoint
series can feed (``FamilySpec.from_checkpoints``, ``detect/families.py``: the attention families
and, for MoE layers, the router weights; the routing entropy needs tokens).

An anomaly is the session's :class:`~mechmon_megatron.session.alert.Alert`, located in the
interval ``(after_iteration, before_iteration]``: the detector fired at the check of
``before_iteration``; the CUSUM's last zero before it is its estimate of the change point, so the
shift began after ``after_iteration``, the earlier checkpoint of the first pair after that zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.detect.families import FAMILIES
from mechmon_megatron.detect.phase_moments import STANDARD_ATTENTION, TrainingSchedule
from mechmon_megatron.detect.pooled_cusum import PooledAlarm
from mechmon_megatron.scan.config import scan_error, scan_flag
from mechmon_megatron.scan.pairs import PairRecord
from mechmon_megatron.scan.schedule import ScanPlan
from mechmon_megatron.session import names
from mechmon_megatron.session.alert import Alert
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.detector_inputs import observation
from mechmon_megatron.session.detector_setup import (
    alert_of,
    build_detector,
    job_shape,
    load_detector_design,
    phase_for_job,
)

__all__ = ["Anomaly", "CheckValues", "ReplayResult", "replay", "scan_families"]


def _finite_or_none(value: Optional[float]) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else value


@dataclass(kw_only=True, frozen=True)
class Anomaly:
    """One fired alarm (the session's alert record), located in checkpoint iterations."""

    after_iteration: int
    before_iteration: int
    alert: Alert

    @property
    def family(self) -> str:
        return self.alert.family

    @property
    def layer(self) -> Optional[int]:
        return self.alert.layer

    @property
    def heads(self) -> list[int]:
        return list(self.alert.heads)

    @property
    def level(self) -> str:
        return self.alert.level

    @property
    def kind(self) -> str:
        return self.alert.kind

    @property
    def layers(self) -> list[int]:
        return list(self.alert.layers)

    @property
    def statistic(self) -> float:
        """The statistic that fired (the alert's ``value``)."""
        return self.alert.value

    @property
    def threshold(self) -> Optional[float]:
        return self.alert.threshold

    @property
    def reason(self) -> str:
        return self.alert.reason

    def to_json(self) -> dict[str, Any]:
        """The entry of ``summary.json``'s ``anomalies`` (non-finite numbers as null)."""
        return {"after_iteration": self.after_iteration, "before_iteration": self.before_iteration,
                "family": self.family, "layer": self.layer, "heads": self.heads, "level": self.level,
                "kind": self.kind, "layers": self.layers, "statistic": _finite_or_none(self.statistic),
                "threshold": _finite_or_none(self.threshold), "reason": self.reason}

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


def scan_families(attn_layers: Sequence[int], router_layers: Sequence[int]) -> dict[str, list[int]]:
    """Family -> layers, for the families a checkpoint series feeds (``FamilySpec.from_checkpoints``):
    the attention ones over ``attn_layers``, the router ones over ``router_layers`` when there are any."""
    out: dict[str, list[int]] = {}
    for spec in FAMILIES:
        if spec.from_checkpoints and (spec.monitor == "attn" or router_layers):
            out[spec.name] = list(attn_layers if spec.monitor == "attn" else router_layers)
    return out


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
    schedule: Optional[TrainingSchedule] = None, attention: str = STANDARD_ATTENTION,
) -> ReplayResult:
    """``records``: check step (later iteration) -> every layer's record of that pair;
    ``schedule`` and ``attention``: the run's learning-rate schedule and attention kind (the
    early-phase correction, when both match the calibration's)."""
    config = session_config(plan, false_alarm_rate, calibration)
    try:
        design, table = load_detector_design(config)
    except ConfigError as exc:
        raise scan_error(exc) from None
    phase, phase_line = phase_for_job(config, table, schedule, attention)
    detector, account = build_detector(config, job_shape(config, [scan_families(attn_layers, router_layers)]),
                                       design, table, phase)
    summary = account.to_dict()
    summary["notes"] = [*summary.get("notes", []), phase_line]
    summary["design"] = {"warmup_checks": design.trend.warmup, "baseline_window_checks": design.trend.window,
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
                alert = Alert(iteration=step, family="nonfinite", stream="weights", layer=record.layer, head=None,
                              value=math.nan, baseline=None, threshold=None, first_warning_step=step,
                              reason=message, level="layer", kind="nonfinite", layers=(record.layer,))
                anomalies.append(Anomaly(after_iteration=earlier, before_iteration=step, alert=alert))
        observations = [
            obs for record in layer_records for stream in record.stream_records()
            if (obs := observation(stream.name, stream.value, stream.limit, stream.limit_reason)) is not None
        ]
        result = detector.update(step, observations)
        for alarm in result.alarms:
            alert = alert_of(alarm, config, design, spell=scan_flag)  # the scan's own flags in the reason
            anomalies.append(Anomaly(after_iteration=_after_iteration(alarm, plan), before_iteration=step,
                                     alert=alert))
        values.scalars.update({f"{names.DETECT_PREFIX}/{k}": v for k, v in result.statistics.items()})
        values.scalars[names.ALARM] = 1.0 if any(a.before_iteration == step for a in anomalies) else 0.0
        values.scalars[names.WARNINGS] = float(len(result.warnings))
        checks.append(values)
    anomalies.sort(key=lambda a: (a.before_iteration, a.after_iteration))
    return ReplayResult(checks=checks, anomalies=anomalies, thresholds=summary)
