"""The per-stream rule of mechmon 0.1 fed with the whole-job detector's inputs, for comparisons.

One :class:`~mechmon_megatron.research.detect_v01.BaselineRelativeDetector` per stream with the
0.1 session defaults (warm-up 10 checks, median/MAD of the last 50, 6 MADs, 5 % floor, patience 3), the
same observations the session's detector sees (``session.detector_inputs``).
"""

from __future__ import annotations

from collections.abc import Iterable

from mechmon_megatron.detect import Observation
from mechmon_megatron.research.detect_v01 import DetectorBank, DetectorEvent, default_detector_configs


def per_stream_bank() -> DetectorBank:
    return DetectorBank(default_detector_configs())


def feed_per_stream(bank: DetectorBank, step: int, observations: Iterable[Observation]) -> list[DetectorEvent]:
    """One check of every observed stream; returns the events (``fired`` marks a new alarm)."""
    return [
        bank.update(f"{o.family}/layer_{o.layer}/{o.member}", step, o.value, family=o.family, limit=o.limit)
        for o in observations
    ]
