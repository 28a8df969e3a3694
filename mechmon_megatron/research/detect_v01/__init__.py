"""The per-stream alarm rule of mechmon 0.1, kept for comparison with the whole-job detector.

Each monitor stream alone against its own median/MAD (or EMA) band, with patience and re-arm
(docs/METHOD.md, "The per-stream rule of mechmon 0.1"). The session has used the whole-job detector
(``mechmon_megatron.detect``) since 0.2; the studies replay this rule on the same observations
(``research.study.per_stream_rule``) to show what the whole-job detector changes.

* :mod:`~mechmon_megatron.research.detect_v01.config` -- :class:`DetectorConfig` and the 0.1
  per-family defaults;
* :mod:`~mechmon_megatron.research.detect_v01.baseline_relative` -- one stream's rule;
* :mod:`~mechmon_megatron.research.detect_v01.bank` -- one rule per stream, keyed by name.
"""

from mechmon_megatron.research.detect_v01.bank import DetectorBank, first_path_component
from mechmon_megatron.research.detect_v01.baseline_relative import (
    DETECTOR_STATE_VERSION,
    BaselineRelativeDetector,
    DetectorEvent,
    Status,
)
from mechmon_megatron.research.detect_v01.config import DetectorConfig, default_detector_configs

__all__ = [
    "DETECTOR_STATE_VERSION",
    "BaselineRelativeDetector",
    "DetectorBank",
    "DetectorConfig",
    "DetectorEvent",
    "Status",
    "default_detector_configs",
    "first_path_component",
]
