"""Robust, drift-following baseline of one monitor stream and its standardised residual.

A stream (e.g. the Delta2 spectral entropy of layer 3, head 5) gives one value per check. Its
healthy level drifts slowly with the learning-rate schedule (the end of warm-up, cosine decay,
the decay phase of WSD). The baseline is a robust straight line through the last ``window``
accepted values, so a steady drift is followed without the lag of a plain median:

- split the window (positions ``0..n-1``, oldest first; the current check is position ``n``)
  into an older and a newer half; ``m_old``, ``m_new`` are their medians at the halves' mean
  positions ``c_old``, ``c_new``;
- slope ``b = (m_new - m_old) / (c_new - c_old)`` (per check), prediction
  ``p = m_new + phi b (n - c_new)`` with a damping ``phi`` in [0, 1] (``slope_damping``); by
  default only a slope towards the fault side is used (``b = 0`` otherwise, see
  ``TrendConfig.fault_side_slope_only``);
- scale ``s = 1.4826 median_i |x_i - (m_new + b (i - c_new))|`` (the MAD of the window about
  the line; sigma for Gaussian noise), floored at ``max(rel_scale_floor |p|, abs_scale_floor)``
  so that a near-constant stream does not turn a tiny change into a large residual.

With fewer than ``min_trend`` values the line is flat (``b = 0``, median and MAD). The
standardised residual is signed so that the fault direction is positive:
``z = (p - x) / s`` for streams that drop under a fault, ``z = (x - p) / s`` for streams that
rise. Which values enter the window is decided by the caller (values seen while the detector
suspects a shift are kept out, so a fault is not absorbed into its own baseline).

Pure Python; state is JSON-serialisable.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, Optional

__all__ = ["RobustTrend", "TrendConfig", "TrendPrediction"]

Direction = Literal["drop", "rise"]
_MAD_TO_SIGMA = 1.4826


@dataclass(kw_only=True, frozen=True, slots=True)
class TrendConfig:
    """Baseline of one stream (all lengths in checks)."""

    window: int = 50
    """Most recent accepted values that form the baseline."""
    warmup: int = 10
    """Accepted values needed before residuals are produced."""
    min_trend: int = 20
    """Accepted values needed before the baseline may slope."""
    rel_scale_floor: float = 0.002
    """Scale floor relative to |prediction| (dimensionless)."""
    abs_scale_floor: float = 1e-3
    """Scale floor in the stream's units (streams whose level is near 0, e.g. similarity)."""
    slope_damping: float = 1.0
    """Share of the fitted slope used to extrapolate (1 = straight line, 0 = flat median)."""
    fault_side_slope_only: bool = True
    """Extrapolate only a slope that points in the fault direction (down for ``drop``). A healthy
    drift towards the fault side must be followed or it reads as a fault; a drift away from it
    (a curve rising to saturation) is left to the flat median, which lags on the safe side
    instead of overshooting where the curve levels off."""

    def __post_init__(self) -> None:
        for name in ("window", "warmup", "min_trend"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"detector {name} must be an integer >= 1, got {value!r}.")
        if self.window < 4 or self.warmup > self.window or self.min_trend > self.window:
            raise ValueError(
                f"detector window ({self.window}) must be >= 4 and >= warmup ({self.warmup}) and min_trend "
                f"({self.min_trend})."
            )
        if not 0.0 <= self.slope_damping <= 1.0:
            raise ValueError(f"detector slope_damping must be in [0, 1], got {self.slope_damping!r}.")
        for name in ("rel_scale_floor", "abs_scale_floor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"detector {name} must be a finite number >= 0, got {value!r}.")


@dataclass(frozen=True, slots=True)
class TrendPrediction:
    """Baseline at the current check, in the stream's units."""

    center: float
    scale: float
    slope: float


class RobustTrend:
    """Window of accepted values of one stream; see the module docstring."""

    def __init__(self, config: TrendConfig, direction: Direction) -> None:
        if direction not in ("drop", "rise"):
            raise ValueError(f"direction must be 'drop' or 'rise', got {direction!r}.")
        self.config = config
        self.direction = direction
        self.values: deque[float] = deque(maxlen=config.window)

    @property
    def ready(self) -> bool:
        """True once ``warmup`` values have been accepted (residuals are defined)."""
        return len(self.values) >= self.config.warmup

    @property
    def young(self) -> bool:
        """True while the window holds fewer than ``window`` values (early in training, or after a
        restart): the phase moments of ``detect/phase_moments.py`` may correct its residual."""
        return len(self.values) < self.config.window

    def predict(self) -> Optional[TrendPrediction]:
        """The baseline at the next check, or None before warm-up."""
        if not self.ready:
            return None
        xs = list(self.values)
        n = len(xs)
        if n < self.config.min_trend:
            center = statistics.median(xs)
            slope = 0.0
            fitted = [center] * n
        else:
            half = n // 2
            old, new = xs[: n - half], xs[n - half :]
            c_old = (len(old) - 1) / 2.0
            c_new = (n - half) + (half - 1) / 2.0
            m_old, m_new = statistics.median(old), statistics.median(new)
            slope = (m_new - m_old) / (c_new - c_old)
            if self.config.fault_side_slope_only and (slope > 0 if self.direction == "drop" else slope < 0):
                slope = 0.0
            center = m_new + self.config.slope_damping * slope * (n - c_new)
            fitted = [m_new + slope * (i - c_new) for i in range(n)]
        mad = statistics.median(abs(x - f) for x, f in zip(xs, fitted))
        floor = max(self.config.rel_scale_floor * abs(center), self.config.abs_scale_floor)
        return TrendPrediction(center=center, scale=max(_MAD_TO_SIGMA * mad, floor), slope=slope)

    def residual(self, value: float, prediction: TrendPrediction) -> float:
        """Standardised residual of ``value``, positive in the fault direction."""
        diff = prediction.center - value if self.direction == "drop" else value - prediction.center
        return diff / prediction.scale

    def accept(self, value: float) -> None:
        """Add a finite value to the window."""
        if math.isfinite(value):
            self.values.append(float(value))

    def reset(self) -> None:
        self.values.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = deque((float(v) for v in state["values"]), maxlen=self.config.window)
