"""Alarm rules for monitor streams (pure Python: the session hands them host floats).

The whole-job detector the session runs (docs/METHOD.md, section 7):

- :mod:`~mechmon_megatron.detect.robust_trend` -- a stream's drift-following robust baseline and
  its standardised residual;
- :mod:`~mechmon_megatron.detect.pooled_cusum` -- residuals pooled per layer and per family,
  one-sided CUSUMs, warnings and alarms, ``state_dict``;
- :mod:`~mechmon_megatron.detect.null_model` -- the measured null tails (``null_tails.json``)
  and the thresholds that one false-alarm rate for the whole job implies.

The per-stream rule of mechmon 0.1 (:class:`BaselineRelativeDetector`, :class:`DetectorBank`) is
kept for comparison and for replaying 0.1 runs; the session no longer uses it.
"""

from mechmon_megatron.detect.bank import DetectorBank, first_path_component
from mechmon_megatron.detect.baseline_relative import (
    DETECTOR_STATE_VERSION,
    BaselineRelativeDetector,
    DetectorEvent,
    Status,
)
from mechmon_megatron.detect.config import DetectorConfig, default_detector_configs
from mechmon_megatron.detect.null_model import (
    DEFAULT_FALSE_ALARM_RATE,
    JobShape,
    NullTail,
    TailTable,
    fit_null_tail,
    load_tail_table,
    thresholds_for_job,
)
from mechmon_megatron.detect.pooled_cusum import (
    FamilyThresholds,
    Observation,
    PooledAlarm,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
    default_sequential_config,
)
from mechmon_megatron.detect.robust_trend import RobustTrend, TrendConfig

__all__ = [
    "DEFAULT_FALSE_ALARM_RATE",
    "DETECTOR_STATE_VERSION",
    "BaselineRelativeDetector",
    "DetectorBank",
    "DetectorConfig",
    "DetectorEvent",
    "FamilyThresholds",
    "JobShape",
    "NullTail",
    "Observation",
    "PooledAlarm",
    "PooledCusumDetector",
    "RobustTrend",
    "SequentialConfig",
    "Status",
    "TailTable",
    "Thresholds",
    "TrendConfig",
    "default_detector_configs",
    "default_sequential_config",
    "first_path_component",
    "fit_null_tail",
    "load_tail_table",
    "thresholds_for_job",
]
