"""Configuration of the 0.1 per-stream alarm rule (:class:`DetectorConfig`) and per-family defaults.

The paper leaves thresholds open ("compare against a healthy baseline, not an absolute value",
docs/METHOD.md section 10), so every number here is configuration with a documented default.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["DetectorConfig", "default_detector_configs"]

Direction = Literal["drop", "rise"]
Center = Literal["median", "ema"]


@dataclass(kw_only=True, slots=True)
class DetectorConfig:
    """Baseline-relative alarm rule for one monitor stream (one value per monitor check)."""

    direction: Direction = "drop"
    """Which deviation is a fault: ``"drop"`` (entropies, effective rank, conditioning ratio)
    or ``"rise"`` (router weight similarity)."""

    warmup: int = 10
    """Checks (not training steps) before any alarm; the baseline is formed from them."""

    window: int = 50
    """Most recent accepted values (checks) that form the robust baseline in ``"median"`` mode."""

    center: Center = "median"
    """Baseline estimator: ``"median"`` (median of the window, scale 1.4826 x MAD) or ``"ema"``
    (EMA with decay ``ema_beta``, scale sqrt(pi/2) x EMA of |deviation|; both scales estimate
    the noise sigma for Gaussian noise)."""

    ema_beta: float = 0.9
    """EMA decay per check in ``"ema"`` mode (dimensionless, in (0, 1)); unused for the median."""

    num_mads: float = 6.0
    """Band half-width in units of the scale: threshold = centre -/+ num_mads x scale."""

    min_rel_change: float = 0.05
    """Floor on the band half-width relative to |centre| (dimensionless), so a near-constant
    stream (scale ~ 0) does not alarm on a tiny change."""

    min_abs_change: float = 0.0
    """Floor on the band half-width in the stream's own units; guards streams whose centre is
    near 0 (e.g. weight similarity), where the relative floor vanishes."""

    patience: int = 3
    """Consecutive out-of-band checks that raise an alarm; shorter runs report ``"warning"``."""

    rearm: int = 5
    """Consecutive in-band checks after an alarm before a new alarm can fire."""

    freeze_baseline_when_out: bool = True
    """Out-of-band values do not enter the baseline, so a slow fault is not absorbed into it
    (trade-off: a legitimate permanent level shift keeps alarming until the detector is reset)."""

    def __post_init__(self) -> None:
        if self.direction not in ("drop", "rise"):
            raise ValueError(f"detector.direction must be 'drop' or 'rise', got {self.direction!r}.")
        if self.center not in ("median", "ema"):
            raise ValueError(f"detector.center must be 'median' or 'ema', got {self.center!r}.")
        for name in ("warmup", "window", "patience", "rearm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"detector.{name} must be an int, got {value!r}.")
        if self.warmup < 1:
            raise ValueError(f"detector.warmup must be >= 1, got {self.warmup}.")
        if self.window < 2:
            raise ValueError(f"detector.window must be >= 2, got {self.window}.")
        if self.patience < 1:
            raise ValueError(f"detector.patience must be >= 1, got {self.patience}.")
        if self.rearm < 1:
            raise ValueError(f"detector.rearm must be >= 1, got {self.rearm}.")
        if not 0.0 < self.ema_beta < 1.0:
            raise ValueError(f"detector.ema_beta must be in (0, 1), got {self.ema_beta}.")
        if not (math.isfinite(self.num_mads) and self.num_mads > 0):
            raise ValueError(f"detector.num_mads must be a finite number > 0, got {self.num_mads}.")
        for name in ("min_rel_change", "min_abs_change"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"detector.{name} must be a finite number >= 0, got {value}.")

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable dict of the fields."""
        return asdict(self)


def default_detector_configs() -> dict[str, DetectorConfig]:
    """Family -> config for the mechanism monitors (fresh objects on every call).

    - ``attn_delta2``: Delta2 spectral entropy per head; falls when updates turn low-rank.
    - ``attn_dw``: dW_q / dW_k spectral entropy; falls (later than Delta2, per the paper).
    - ``router_entropy``: full-softmax routing entropy per MoE layer; falls on collapse.
    - ``router_weights``: router weight similarity; rises on collapse. Its centre starts near 0
      (random rows), so an absolute floor of 0.02 (cosine units) replaces the relative one.
    - ``router_conditioning``: router conditioning ratio eps; falls as rows become redundant.

    Shared defaults: warmup 10 checks, median of the last 50 accepted checks, band 6 x 1.4826 MAD
    with a 5 % relative floor, alarm after 3 consecutive out-of-band checks, re-arm after 5
    in-band checks, out-of-band values kept out of the baseline.
    """
    return {
        "attn_delta2": DetectorConfig(direction="drop"),
        "attn_dw": DetectorConfig(direction="drop"),
        "router_entropy": DetectorConfig(direction="drop"),
        "router_weights": DetectorConfig(direction="rise", min_abs_change=0.02),
        "router_conditioning": DetectorConfig(direction="drop"),
    }
