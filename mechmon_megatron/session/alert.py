"""The alert record: what alarmed, where, and which checkpoint to roll back to.

One alarm has one shape, :class:`Alert`, whoever holds it: the session builds it (from the
detector's ``PooledAlarm`` in ``detector_setup.alert_of``, from a non-finite report, for a drill),
broadcasts it to every rank, logs it, posts it to the webhook and writes it in
``mechmon_alert.json`` (:class:`AlertReport`, which DeepSpeed also keeps in the checkpoint's
``client_state``); ``mechmon-scan`` reports its alarms as alerts; ``mechmon-supervise`` reads them
back with :meth:`AlertReport.from_json`. Standard library only: the supervisor runs without torch.

``mechmon_alert.json`` (``ALERT_FORMAT`` 1): ``format``; the report's ``iteration``; the first
alert's ``family``, ``layer``, ``head``, ``value``, ``baseline``, ``threshold``,
``first_warning_step``, ``layers``, ``heads`` (what a reader of one alarm needs, at the top);
``last_checkpoint_before_first_warning``, ``checkpoint_dir``, ``action``, ``exit_code``; and
``alerts``, every alert with all its fields. A file without ``format`` (written before it existed,
or by hand with the top-level keys only) still loads.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, get_args

from mechmon_megatron.detect.families import FAMILY_NAMES

ALERT_FILENAME = "mechmon_alert.json"
ALERT_FORMAT = 1
"""Version of ``mechmon_alert.json``; a file without the key is read as format 1."""
ALERT_FAMILIES = (*FAMILY_NAMES, "nonfinite", "drill")
"""Every ``family`` an alert can carry: a detector family (``detect/families.py``), a non-finite
monitor value, a drill."""

AlertKind = Literal["cusum", "shewhart", "limit", "nonfinite", ""]
"""``cusum`` / ``shewhart``: a pooled test of the detector; ``limit``: a stream beyond its absolute
limit (the routing-entropy floor); ``nonfinite``: a non-finite value or weight; empty for a drill."""
AlertLevel = Literal["layer", "family", ""]
"""The detector test that fired (one layer, or the family pooled over its layers); empty when no
test did (a non-finite weight, a drill)."""

_KINDS: tuple[str, ...] = get_args(AlertKind)
_LEVELS: tuple[str, ...] = get_args(AlertLevel)


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def _choice(value: Any, choices: tuple[str, ...], key: str) -> Any:
    if value not in choices:
        raise ValueError(f"{key} {value!r} is not one of {list(choices)}")
    return value


@dataclass(frozen=True, kw_only=True)
class Alert:
    """One alarm, attributed to a monitor family, a global layer and (for attention) a head.

    Built with keywords only. ``layer`` is the global 1-based layer number (None for job-wide
    alarms such as a drill), ``first_warning_step`` the earliest step the shift can have begun.
    """

    iteration: int
    family: str
    """One of :data:`ALERT_FAMILIES`."""
    stream: str
    """What fired: the detector statistic (``mechmon/detect/<family>/cusum[/layer_L]``), the stream
    (``<family>/layer_L``), ``weights`` or ``drill``."""
    layer: Optional[int]
    head: Optional[int]
    value: float
    """The statistic (or the stream's value) that fired; NaN for a non-finite value."""
    baseline: Optional[float]
    threshold: Optional[float]
    first_warning_step: Optional[int]
    reason: str = ""
    level: AlertLevel = ""
    kind: AlertKind = ""
    layers: tuple[int, ...] = ()
    """Every layer that carries the alarm (a family alarm names several)."""
    heads: tuple[int, ...] = ()
    """Query heads that carry it (residual >= 2 pooled units), in the first layer."""

    def to_json(self) -> dict[str, Any]:
        """Every field, in declaration order (``layers`` / ``heads`` as lists); NaN stays NaN."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["layers"], out["heads"] = list(self.layers), list(self.heads)
        return out

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Alert:
        """The alert of :meth:`to_json`'s dict. ``iteration`` and a non-empty ``family`` are
        required; the other keys may be missing (a hand-written or older file: their defaults).
        ``KeyError``, ``TypeError`` or ``ValueError`` on a malformed body."""
        if not isinstance(body, Mapping):
            raise TypeError(f"an alert is a JSON object, got {type(body).__name__}")
        family = body["family"]
        if not isinstance(family, str) or not family:
            raise ValueError("no family")
        value = body.get("value")
        return cls(
            iteration=int(body["iteration"]),
            family=family,
            stream=str(body.get("stream", "")),
            layer=_optional_int(body.get("layer")),
            head=_optional_int(body.get("head")),
            value=math.nan if value is None else float(value),
            baseline=_optional_float(body.get("baseline")),
            threshold=_optional_float(body.get("threshold")),
            first_warning_step=_optional_int(body.get("first_warning_step")),
            reason=str(body.get("reason", "")),
            level=_choice(body.get("level", ""), _LEVELS, "level"),
            kind=_choice(body.get("kind", ""), _KINDS, "kind"),
            layers=tuple(int(x) for x in body.get("layers") or ()),
            heads=tuple(int(x) for x in body.get("heads") or ()),
        )

    def describe(self) -> str:
        if len(self.layers) > 1:
            where = "layers " + ",".join(str(n) for n in self.layers)
        else:
            where = f"layer {self.layer}" if self.layer is not None else "job"
        if self.heads:
            where += " heads " + ",".join(str(h) for h in self.heads)
        elif self.head is not None:
            where += f" head {self.head}"
        if self.kind == "cusum":
            head = f"[mechmon] ALARM at iteration {self.iteration}: {self.family} {where}"
            return f"{head}: {self.reason}; began after step {self.first_warning_step}."
        detail = f"value {self.value:.6g}"
        if self.baseline is not None:
            detail += f", baseline {self.baseline:.6g}"
        elif self.threshold is not None:
            detail += ", no baseline yet (the detector is learning it: warm-up, or again after an alarm)"
        if self.threshold is not None:
            detail += f", threshold {self.threshold:.6g}"
        head = f"[mechmon] ALARM at iteration {self.iteration}: {self.family} {where} ({self.stream})"
        return f"{head}: {detail}. {self.reason}".strip()


_HEADLINE = ("family", "layer", "head", "value", "baseline", "threshold", "first_warning_step", "layers", "heads")
"""The first alert's fields copied to the top of ``mechmon_alert.json``."""
_REPORT_KEYS = frozenset({"format", "iteration", *_HEADLINE, "last_checkpoint_before_first_warning",
                          "checkpoint_dir", "action", "exit_code", "alerts"})


@dataclass(frozen=True, kw_only=True)
class AlertReport:
    """Content of ``mechmon_alert.json``: the alerts of an abort, and where to roll back to."""

    iteration: int
    alerts: tuple[Alert, ...]
    checkpoint_dir: Optional[str]
    last_checkpoint_before_first_warning: Optional[dict]
    exit_code: Optional[int]
    action: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Other top-level keys (written after the known ones, kept when read back)."""

    def to_json(self) -> dict[str, Any]:
        first = self.alerts[0].to_json() if self.alerts else None
        body: dict[str, Any] = {"format": ALERT_FORMAT, "iteration": self.iteration}
        for key in _HEADLINE:
            body[key] = first[key] if first else ([] if key in ("layers", "heads") else None)
        body.update({
            "last_checkpoint_before_first_warning": self.last_checkpoint_before_first_warning,
            "checkpoint_dir": self.checkpoint_dir,
            "action": self.action,
            "exit_code": self.exit_code,
            "alerts": [a.to_json() for a in self.alerts],
        })
        body.update(self.extra)
        return body

    @classmethod
    def of_abort(cls, iteration: int, alerts: Sequence[Alert], checkpoints: Sequence[Mapping[str, Any]],
                 checkpoint_dir: Optional[str], exit_code: Optional[int], action: str) -> AlertReport:
        """The report of an abort at ``iteration`` with the alerts of its check: the last of
        ``checkpoints`` (``{"iteration", "path"}``, in save order) saved before the first warning
        step of any of those alerts is where to roll back to."""
        starts = [a.iteration if a.first_warning_step is None else a.first_warning_step for a in alerts]
        first_warning = min(starts) if starts else iteration
        before = [c for c in checkpoints if c["iteration"] < first_warning]
        return cls(
            iteration=iteration,
            alerts=tuple(alerts),
            checkpoint_dir=checkpoint_dir,
            last_checkpoint_before_first_warning=dict(before[-1]) if before else None,
            exit_code=exit_code,
            action=action,
        )

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> AlertReport:
        """The report of :meth:`to_json`'s dict. A body without ``alerts`` (hand-written, with the
        top-level keys only) holds one alert, read from those keys. ``KeyError``, ``TypeError`` or
        ``ValueError`` on a malformed body, or one of a newer format."""
        if not isinstance(body, Mapping):
            raise TypeError(f"an alert report is a JSON object, got {type(body).__name__}")
        version = body.get("format", ALERT_FORMAT)
        if not isinstance(version, int) or isinstance(version, bool) or version > ALERT_FORMAT:
            raise ValueError(f"format {version!r}: written by a newer mechmon-megatron (this one reads "
                             f"format <= {ALERT_FORMAT})")
        listed = body.get("alerts")
        if listed is None:
            alerts: tuple[Alert, ...] = (Alert.from_json(body),)
        elif isinstance(listed, Sequence) and not isinstance(listed, str):
            alerts = tuple(Alert.from_json(a) for a in listed)
        else:
            raise TypeError(f"alerts must be a list, got {type(listed).__name__}")
        return cls(
            iteration=int(body["iteration"]),
            alerts=alerts,
            checkpoint_dir=body.get("checkpoint_dir"),
            last_checkpoint_before_first_warning=body.get("last_checkpoint_before_first_warning"),
            exit_code=body.get("exit_code"),
            action=str(body.get("action", "")),
            extra={k: v for k, v in body.items() if k not in _REPORT_KEYS},
        )

    def write(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, ALERT_FILENAME)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2, allow_nan=True)
        os.replace(tmp, path)  # readers never see a half-written alert
        return path
