"""A collection of baseline-relative detectors keyed by stream name.

Stream names are ``/``-separated, lower_snake (e.g. ``"attn_delta2/layer_3/head_5"``). Each
stream belongs to a family (``attn_delta2``, ``router_entropy``, ...) whose
:class:`~mechmon_megatron.research.detect_v01.config.DetectorConfig` builds its detector on first
use. The family is the ``family=`` argument of the first ``update`` for that stream, else
``family_of(name)`` (by default the first path component of the name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from mechmon_megatron.research.detect_v01.baseline_relative import BaselineRelativeDetector, DetectorEvent
from mechmon_megatron.research.detect_v01.config import DetectorConfig, default_detector_configs

__all__ = ["BANK_STATE_VERSION", "DetectorBank", "first_path_component"]

BANK_STATE_VERSION = 1


def first_path_component(name: str) -> str:
    """Default family resolver: ``"attn_delta2/layer_3/head_5"`` -> ``"attn_delta2"``."""
    return name.split("/", 1)[0]


class DetectorBank(Mapping[str, BaselineRelativeDetector]):
    """Lazily created detectors, one per stream; read-only mapping ``name -> detector``.

    Deterministic: iteration, :meth:`alarms` and :meth:`state_dict` are sorted by stream name.
    """

    def __init__(
        self,
        configs: Mapping[str, DetectorConfig] | None = None,
        family_of: Callable[[str], str] = first_path_component,
    ) -> None:
        self.configs: dict[str, DetectorConfig] = dict(default_detector_configs() if configs is None else configs)
        for family, cfg in self.configs.items():
            if not isinstance(cfg, DetectorConfig):
                raise ValueError(f"detector family {family!r} needs a DetectorConfig, got {type(cfg).__name__}.")
        self.family_of = family_of
        self._detectors: dict[str, BaselineRelativeDetector] = {}
        self._families: dict[str, str] = {}

    def _create(self, name: str, family: str | None) -> BaselineRelativeDetector:
        fam = family if family is not None else self.family_of(name)
        if fam not in self.configs:
            raise ValueError(
                f"stream {name!r} maps to unknown detector family {fam!r}; known families: "
                f"{sorted(self.configs)}. Pass family=... or add a DetectorConfig for it."
            )
        det = BaselineRelativeDetector(self.configs[fam], name=name)
        self._detectors[name] = det
        self._families[name] = fam
        return det

    def update(
        self, name: str, step: int, value: float, family: str | None = None, limit: float | None = None
    ) -> DetectorEvent:
        """Feed ``value`` of stream ``name`` at ``step``; creates the detector on first use.

        ``limit``: optional absolute limit of this check in stream units
        (:meth:`BaselineRelativeDetector.update`).
        """
        det = self._detectors.get(name)
        if det is None:
            det = self._create(name, family)
        elif family is not None and family != self._families[name]:
            raise ValueError(f"stream {name!r} belongs to family {self._families[name]!r}, not {family!r}.")
        return det.update(step, value, limit=limit)

    def family(self, name: str) -> str:
        """Family of an existing stream."""
        return self._families[name]

    def alarms(self) -> list[DetectorEvent]:
        """Latest events whose status is ``"alarm"``, sorted by stream name."""
        return [
            det.last_event
            for _, det in sorted(self._detectors.items())
            if det.last_event is not None and det.last_event.is_alarm
        ]

    def first_alarm_steps(self) -> dict[str, int]:
        """Stream -> step of its first fired alarm, for streams that have alarmed (sorted)."""
        return {n: d.first_alarm_step for n, d in sorted(self._detectors.items()) if d.first_alarm_step is not None}

    def __getitem__(self, name: str) -> BaselineRelativeDetector:
        return self._detectors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._detectors))

    def __len__(self) -> int:
        return len(self._detectors)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable ``{"version": 1, "streams": {name: {"family", "detector"}}}``."""
        return {
            "version": BANK_STATE_VERSION,
            "streams": {
                name: {"family": self._families[name], "detector": det.state_dict()}
                for name, det in sorted(self._detectors.items())
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace all detectors with the saved ones; ``ValueError`` on version/config mismatch.

        Latest events are not saved, so :meth:`alarms` is empty until the next updates.
        """
        if state.get("version") != BANK_STATE_VERSION:
            raise ValueError(
                f"detector bank state version {state.get('version')!r} is not {BANK_STATE_VERSION}; "
                "it was written by an incompatible mechmon-megatron."
            )
        detectors: dict[str, BaselineRelativeDetector] = {}
        families: dict[str, str] = {}
        for name, entry in state["streams"].items():
            fam = entry["family"]
            if fam not in self.configs:
                raise ValueError(
                    f"saved stream {name!r} uses detector family {fam!r}, which this bank does not configure "
                    f"(known: {sorted(self.configs)})."
                )
            det = BaselineRelativeDetector(self.configs[fam], name=name)
            det.load_state_dict(entry["detector"])
            detectors[name], families[name] = det, fam
        # Only swap in once every entry loaded, so a failed load leaves the bank unchanged.
        self._detectors, self._families = detectors, families
