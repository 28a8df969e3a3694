"""The monitor state a checkpoint holds: one typed, versioned layout (:class:`MonitorState`).

``MonitoringSession.state_dict()`` is ``MonitorState.to_dict()`` and ``load_state_dict(d)`` reads
``MonitorState.from_dict(d)``. The dict is what every host stores under the one key ``"mechmon"``
of its checkpoint container (``session/state_format.py``); its keys never change, so every
checkpoint written since version 1 loads:

===============  ==========================================================================
key              value
===============  ==========================================================================
``version``      :data:`STATE_VERSION` (2); 1: mechmon 0.1's per-stream detector
``interval``     ``--mechmon-interval`` the detector's baselines were built at (None in older states)
``delta``        ``--mechmon-delta`` of those baselines (None in older states)
``detector``     the writer rank's detector state (``PooledCusumDetector.state_dict``); None elsewhere
``checkpoints``  ``[{"iteration": i, "path": p}]``: the checkpoints saved so far
``errors``       this rank's monitor failures so far (``mechmon/errors`` sums them over ranks)
===============  ==========================================================================

What a resume does with it (``MonitoringSession.load_state_dict``, called before
``on_train_start``; a loaded state marks the launch a resume, which continues its run in the
records). Another delta drops the detector state: its baselines hold Delta2 / dW over the old
window, and over another window these are other statistics (level and spread depend on the update
noise the window averages), so the change of flag would read as a shift; the baselines rebuild.
Another interval with the same delta keeps it: a baseline is the last accepted values of the same
statistic, counted in checks, still samples of its healthy level and spread; the warm-up length
and the thresholds follow the new interval from the first check, and only the per-check slope
mixes two spacings until the window has refilled. ``on_train_start`` says which happened, with the
step the detector arms at (docs/METHOD.md, section 5). A version 1 state's detector is not reused
(one warning); its checkpoint list and error count are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["STATE_VERSION", "SUPPORTED_VERSIONS", "MonitorState"]

STATE_VERSION = 2
"""Format of the saved monitor state, not the package version (``mechmon_megatron.__version__``): it
changes only when the format does. 2: the whole-job detector (since 0.2); 1: the per-stream
detector of 0.1 (its baselines are not reused)."""
SUPPORTED_VERSIONS = (STATE_VERSION, 1)
"""Versions :meth:`MonitorState.from_dict` reads."""


@dataclass(frozen=True)
class MonitorState:
    """One rank's saved monitor state (see the module docstring for each field)."""

    version: int = STATE_VERSION
    interval: Optional[int] = None
    delta: Optional[int] = None
    detector: Optional[dict] = None
    checkpoints: tuple[dict, ...] = ()
    errors: int = 0

    @property
    def detector_reusable(self) -> bool:
        """Whether the detector state can judge this version's statistics (not mechmon 0.1's)."""
        return self.version == STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The dict a checkpoint holds (the same keys, in the same order, as every version wrote)."""
        return {
            "version": self.version,
            # the schedule the detector's baselines were built at (a resume compares it with its own)
            "interval": self.interval,
            "delta": self.delta,
            "detector": self.detector,
            "checkpoints": list(self.checkpoints),
            "errors": self.errors,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> MonitorState:
        """The state a checkpoint held; ``ValueError`` for a version this release cannot read."""
        version = state.get("version")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"mechmon state version {version} is not supported (expected {STATE_VERSION} or 1)")
        return cls(
            version=int(version),
            interval=state.get("interval"),
            delta=state.get("delta"),
            detector=state.get("detector"),
            checkpoints=tuple(state.get("checkpoints", [])),
            errors=int(state.get("errors", 0)),
        )
