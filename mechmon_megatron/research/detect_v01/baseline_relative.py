"""The per-stream alarm rule of mechmon 0.1: a robust, baseline-relative band with patience and re-arm.

Per check (one value of one stream, e.g. the Delta2 spectral entropy of layer 3 head 5):

1. Non-finite value: status ``"alarm"`` at once (a NaN monitor means the weights or the
   monitor are already broken; waiting for patience would only delay the report). It never
   enters the baseline and counts as an out-of-band check.
2. Fewer than ``warmup`` finite values seen: status ``"warmup"``; the value enters the baseline.
3. Otherwise compare with the baseline of past accepted values:
   ``half_width = max(num_mads * scale, min_rel_change * |centre|, min_abs_change)``;
   threshold = centre - half_width (``drop``) or centre + half_width (``rise``). The value is
   out of band when it lies strictly beyond the threshold.
4. The first ``patience - 1`` consecutive out-of-band checks are ``"warning"``; the
   ``patience``-th fires an alarm (``fired=True``). The alarm episode lasts (out-of-band checks
   report ``"alarm"`` without firing again) until ``rearm`` consecutive in-band checks re-arm it.
5. In-band values (and, unless ``freeze_baseline_when_out``, out-of-band ones) enter the
   baseline after the decision, so a value never judges itself.

Optional absolute limit (``update(..., limit=x)``, in stream units) that stands in for the
baseline while there is none: during warm-up a value beyond it (below for ``drop``, above for
``rise``) is out of band (patience applies) and is not absorbed, so a stream that starts out
collapsed never forms a baseline and stays judged by the limit. Once ``warmup`` values within
the limit have formed the baseline, the baseline-relative band alone decides (a healthy stream
may drift past an absolute level over a long run; the paper asks for healthy-baseline
comparisons). It exists for faults that start with training, which a baseline formed in the
first checks would absorb (e.g. a routing-entropy collapse under a mis-set learning rate: the
session's limit is log(top-k), see ``session.router_check``; the 0.2 detector keeps that limit,
``detect.pooled_cusum``).

``scale`` is 1.4826 x MAD of the window (``median``) or sqrt(pi/2) x EMA of |deviation|
(``ema``); a zero scale (constant stream) is covered by the relative / absolute floors.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from mechmon_megatron.research.detect_v01.config import DetectorConfig

__all__ = ["DETECTOR_STATE_VERSION", "BaselineRelativeDetector", "DetectorEvent", "Status"]

DETECTOR_STATE_VERSION = 1

Status = Literal["warmup", "ok", "warning", "alarm"]

_MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): MAD -> sigma for Gaussian noise
_MEAN_ABS_DEV_TO_SIGMA = math.sqrt(math.pi / 2.0)  # E|X - mu| = sigma sqrt(2/pi) for Gaussian noise


@dataclass(frozen=True, slots=True)
class DetectorEvent:
    """Decision for one check of one stream. Values are in the stream's units.

    Attributes:
        step: training step of the check.
        value: the observed value.
        baseline: centre of the baseline before this value (NaN during an empty warmup).
        scale: noise scale estimate before this value (NaN while warming up).
        threshold: the band edge the value was compared with (NaN while warming up).
        status: ``"warmup"``, ``"ok"``, ``"warning"`` or ``"alarm"``.
        fired: True only on the check where a new alarm fires (count alarms with it).
        first_warning_step: step of the first check of the current out-of-band run, None when
            in band; on an alarm it gives the warning lead time.
        name: stream name (set by :class:`~mechmon_megatron.research.detect_v01.bank.DetectorBank`).
        limit: the absolute limit of this check (NaN when none was given).
        beyond_limit: True when the value lay beyond ``limit`` during warm-up (out of band
            because of it; after warm-up the limit is not used and this is False).
    """

    step: int
    value: float
    baseline: float
    scale: float
    threshold: float
    status: Status
    fired: bool = False
    first_warning_step: int | None = None
    name: str = ""
    limit: float = math.nan
    beyond_limit: bool = False

    @property
    def is_alarm(self) -> bool:
        """True while the stream is in an alarm episode and this check is out of band."""
        return self.status == "alarm"


class BaselineRelativeDetector:
    """Alarm rule for one scalar stream; see the module docstring for the decision procedure.

    Attributes:
        first_alarm_step: step of the first fired alarm, None if none yet.
        first_warning_step: step of the first out-of-band check ever, None if none yet.
        num_alarms: fired alarms so far.
    """

    def __init__(self, config: DetectorConfig, name: str = "") -> None:
        if not isinstance(config, DetectorConfig):
            raise ValueError(f"BaselineRelativeDetector needs a DetectorConfig, got {type(config).__name__}.")
        self.config = config
        self.name = name
        self.reset()

    def reset(self) -> None:
        """Forget the baseline and all alarm history (e.g. after an intended regime change)."""
        self._history: deque[float] = deque(maxlen=self.config.window)
        self._ema_center: float | None = None
        self._ema_absdev = 0.0
        self._ema_num_devs = 0
        self._num_finite = 0
        self._out_run = 0
        self._in_run = 0
        self._in_alarm = False
        self._run_start_step: int | None = None
        self.first_alarm_step: int | None = None
        self.first_warning_step: int | None = None
        self.num_alarms = 0
        self.last_event: DetectorEvent | None = None

    # -- baseline -----------------------------------------------------------------------------

    def baseline(self) -> tuple[float, float]:
        """``(centre, scale)`` of the current baseline; NaNs when it is empty."""
        if self.config.center == "median":
            if not self._history:
                return math.nan, math.nan
            values = list(self._history)
            centre = statistics.median(values)
            mad = statistics.median(abs(x - centre) for x in values)
            return float(centre), _MAD_TO_SIGMA * float(mad)
        if self._ema_center is None:
            return math.nan, math.nan
        if self._ema_num_devs == 0:
            return self._ema_center, 0.0
        # Bias correction: the |deviation| EMA starts at 0.
        absdev = self._ema_absdev / (1.0 - self.config.ema_beta**self._ema_num_devs)
        return self._ema_center, _MEAN_ABS_DEV_TO_SIGMA * absdev

    def _absorb(self, value: float) -> None:
        if self.config.center == "median":
            self._history.append(value)
            return
        beta = self.config.ema_beta
        if self._ema_center is None:
            self._ema_center = value
            return
        self._ema_absdev = beta * self._ema_absdev + (1.0 - beta) * abs(value - self._ema_center)
        self._ema_num_devs += 1
        self._ema_center = beta * self._ema_center + (1.0 - beta) * value

    def _threshold(self, centre: float, scale: float) -> float:
        c = self.config
        half_width = max(c.num_mads * scale, c.min_rel_change * abs(centre), c.min_abs_change)
        return centre - half_width if c.direction == "drop" else centre + half_width

    # -- decision -----------------------------------------------------------------------------

    def update(self, step: int, value: float, limit: float | None = None) -> DetectorEvent:
        """Judge ``value`` (stream units) observed at training ``step``; returns the event.

        ``limit``: optional absolute limit in stream units, used until the baseline is formed
        (see the module docstring); it is given per check, not stored, so the caller may derive
        it from the model's shape.
        """
        step, value = int(step), float(value)
        limit = math.nan if limit is None else float(limit)
        beyond = self._beyond(value, limit)
        centre, scale = self.baseline()
        if not math.isfinite(value):
            threshold = self._threshold(centre, scale) if self._num_finite >= self.config.warmup else math.nan
            event = self._out_of_band(step, value, centre, scale, threshold, limit, False, force_alarm=True)
        elif self._num_finite < self.config.warmup:
            if beyond:
                event = self._out_of_band(step, value, centre, scale, limit, limit, True, force_alarm=False)
            else:
                self._num_finite += 1
                self._absorb(value)
                event = self._in_band(step, value, centre, scale, math.nan, limit, status="warmup")
        else:
            self._num_finite += 1
            threshold = self._threshold(centre, scale)
            out = value < threshold if self.config.direction == "drop" else value > threshold
            if out:
                event = self._out_of_band(step, value, centre, scale, threshold, limit, False, force_alarm=False)
                if not self.config.freeze_baseline_when_out:
                    self._absorb(value)
            else:
                event = self._in_band(step, value, centre, scale, threshold, limit)
                self._absorb(value)
        self.last_event = event
        return event

    def _beyond(self, value: float, limit: float) -> bool:
        if math.isnan(limit) or not math.isfinite(value):
            return False
        return value < limit if self.config.direction == "drop" else value > limit

    def _in_band(
        self, step: int, value: float, centre: float, scale: float, threshold: float, limit: float,
        status: Status = "ok",
    ) -> DetectorEvent:
        self._out_run = 0
        self._run_start_step = None
        self._in_run += 1
        if self._in_alarm and self._in_run >= self.config.rearm:
            self._in_alarm = False
        return DetectorEvent(step, value, centre, scale, threshold, status, name=self.name, limit=limit)

    def _out_of_band(
        self, step: int, value: float, centre: float, scale: float, threshold: float, limit: float,
        beyond_limit: bool, force_alarm: bool,
    ) -> DetectorEvent:
        self._in_run = 0
        self._out_run += 1
        if self._run_start_step is None:
            self._run_start_step = step
        if self.first_warning_step is None:
            self.first_warning_step = step
        fired = False
        if self._in_alarm:
            status: Status = "alarm"
        elif force_alarm or self._out_run >= self.config.patience:
            status, fired = "alarm", True
            self._in_alarm = True
            self.num_alarms += 1
            if self.first_alarm_step is None:
                self.first_alarm_step = step
        else:
            status = "warning"
        return DetectorEvent(
            step, value, centre, scale, threshold, status, fired, self._run_start_step, self.name, limit, beyond_limit
        )

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (plain lists, floats, ints, None)."""
        return {
            "version": DETECTOR_STATE_VERSION,
            "config": self.config.to_dict(),
            "history": list(self._history),
            "ema_center": self._ema_center,
            "ema_absdev": self._ema_absdev,
            "ema_num_devs": self._ema_num_devs,
            "num_finite": self._num_finite,
            "out_run": self._out_run,
            "in_run": self._in_run,
            "in_alarm": self._in_alarm,
            "run_start_step": self._run_start_step,
            "first_alarm_step": self.first_alarm_step,
            "first_warning_step": self.first_warning_step,
            "num_alarms": self.num_alarms,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; ``ValueError`` on another version or config."""
        if state.get("version") != DETECTOR_STATE_VERSION:
            raise ValueError(
                f"detector {self.name!r}: state version {state.get('version')!r} is not "
                f"{DETECTOR_STATE_VERSION}; it was written by an incompatible mechmon-megatron."
            )
        if state.get("config") != self.config.to_dict():
            raise ValueError(
                f"detector {self.name!r}: saved config {state.get('config')} differs from the current "
                f"{self.config.to_dict()}; resume with the saved detector settings or start a fresh baseline."
            )
        self._history = deque((float(x) for x in state["history"]), maxlen=self.config.window)
        ema_center = state["ema_center"]
        self._ema_center = None if ema_center is None else float(ema_center)
        self._ema_absdev = float(state["ema_absdev"])
        self._ema_num_devs = int(state["ema_num_devs"])
        self._num_finite = int(state["num_finite"])
        self._out_run = int(state["out_run"])
        self._in_run = int(state["in_run"])
        self._in_alarm = bool(state["in_alarm"])
        self._run_start_step = state["run_start_step"]
        self.first_alarm_step = state["first_alarm_step"]
        self.first_warning_step = state["first_warning_step"]
        self.num_alarms = int(state["num_alarms"])
        self.last_event = None

    def __repr__(self) -> str:
        return f"BaselineRelativeDetector(name={self.name!r}, config={self.config!r})"
