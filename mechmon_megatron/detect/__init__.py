"""Alarm rules for monitor streams (pure Python: the session hands them host floats).

The whole-job detector the session runs (docs/METHOD.md, section 7):

- :mod:`~mechmon_megatron.detect.families` -- the detector's families, declared once
  (``FamilySpec``: direction, scalars, switch, start-up lines, the shipped remedy), read
  by the detector, the session, scan and the supervisor;
- :mod:`~mechmon_megatron.detect.robust_trend` -- a stream's drift-following robust baseline and
  its standardised residual;
- :mod:`~mechmon_megatron.detect.pooled_cusum` -- residuals pooled per layer and per family,
  one-sided CUSUMs, warnings and alarms, ``state_dict``;
- :mod:`~mechmon_megatron.detect.null_model` -- the measured null tails (``null_tails.json``)
  and the thresholds that one false-alarm rate for the whole job implies;
- :mod:`~mechmon_megatron.detect.misfit` -- the calibration misfit counter (healthy-phase warning
  episodes against the tail model's prediction).

The per-stream rule of mechmon 0.1, which the session no longer uses, lives with the studies
that compare against it: ``mechmon_megatron.research.detect_v01``.
"""

from mechmon_megatron.detect.misfit import MisfitCounter
from mechmon_megatron.detect.null_model import (
    DEFAULT_FALSE_ALARM_RATE,
    SHEWHART_SHARE,
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
    "FamilyThresholds",
    "JobShape",
    "MisfitCounter",
    "NullTail",
    "Observation",
    "PooledAlarm",
    "PooledCusumDetector",
    "RobustTrend",
    "SHEWHART_SHARE",
    "SequentialConfig",
    "TailTable",
    "Thresholds",
    "TrendConfig",
    "default_sequential_config",
    "fit_null_tail",
    "load_tail_table",
    "thresholds_for_job",
]
