"""The alert record: what alarmed, where, and which checkpoint to roll back to."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

ALERT_FILENAME = "mechmon_alert.json"
DETECTOR_FAMILIES = ("attn_delta2", "attn_dw", "attn_delta2_short", "router_entropy", "router_weights")
"""The detector's families (``detect.pooled_cusum.FAMILY_DIRECTIONS``, ``session.records.Family``;
a test keeps the three equal), spelled here for the standard-library-only supervisor."""
ALERT_FAMILIES = (*DETECTOR_FAMILIES, "nonfinite", "drill")
"""Every ``family`` an alert can carry: a detector family, a non-finite monitor value, a drill."""


@dataclass(kw_only=True)
class Alert:
    """One alarm, attributed to a monitor family, a global layer and (for attention) a head.

    Built with keywords only (ten fields). ``layer`` is the global 1-based layer number (None
    for job-wide alarms such as a drill), ``first_warning_step`` the first check of the episode.
    """

    iteration: int
    family: str
    stream: str
    layer: Optional[int]
    head: Optional[int]
    value: float
    baseline: Optional[float]
    threshold: Optional[float]
    first_warning_step: Optional[int]
    reason: str = ""
    level: str = ""
    """``layer`` or ``family`` for a detector (CUSUM) alarm; empty otherwise."""
    kind: str = ""
    """``cusum``, ``limit`` (routing-entropy floor) or ``nonfinite``; empty for a drill."""
    layers: list[int] = field(default_factory=list)
    """Every layer that carries the alarm (a family alarm names several)."""
    heads: list[int] = field(default_factory=list)
    """Query heads that carry it (residual >= 2 pooled units), in the first layer."""

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


@dataclass
class AlertReport:
    """Content of ``mechmon_alert.json``."""

    iteration: int
    alerts: list[Alert]
    checkpoint_dir: Optional[str]
    last_checkpoint_before_first_warning: Optional[dict]
    exit_code: Optional[int]
    action: str
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        first = self.alerts[0] if self.alerts else None
        body = {
            "iteration": self.iteration,
            "family": first.family if first else None,
            "layer": first.layer if first else None,
            "head": first.head if first else None,
            "value": first.value if first else None,
            "baseline": first.baseline if first else None,
            "threshold": first.threshold if first else None,
            "first_warning_step": first.first_warning_step if first else None,
            "layers": first.layers if first else [],
            "heads": first.heads if first else [],
            "last_checkpoint_before_first_warning": self.last_checkpoint_before_first_warning,
            "checkpoint_dir": self.checkpoint_dir,
            "action": self.action,
            "exit_code": self.exit_code,
            "alerts": [asdict(a) for a in self.alerts],
        }
        body.update(self.extra)
        return body

    def write(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, ALERT_FILENAME)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2, allow_nan=True)
        os.replace(tmp, path)  # readers never see a half-written alert
        return path
