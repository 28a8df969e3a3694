"""Alarm rules for monitor streams: baseline-relative detectors and their configuration.

Pure Python (no torch needed): detectors consume host floats that the session has already
reduced and copied off the device.
"""

from mechmon_megatron.detect.bank import DetectorBank, first_path_component
from mechmon_megatron.detect.baseline_relative import (
    DETECTOR_STATE_VERSION,
    BaselineRelativeDetector,
    DetectorEvent,
    Status,
)
from mechmon_megatron.detect.config import DetectorConfig, default_detector_configs

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
