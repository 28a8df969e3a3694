"""Per-pair results kept in ``OUT/cache/``, so an interrupted scan continues where it stopped.

One JSON-lines file per layer, ``layer_0003.jsonl``: a header ``{"version", "fingerprint"}``
then one :class:`~mechmon_megatron.scan.pairs.PairRecord` per line, appended and flushed to disk
as soon as it is computed. A line cut short by a kill is ignored on the next run (it is always
the last one). The fingerprint covers what the values depend on (the checkpoints' paths,
iterations and modification times, the head layout, alpha, the kernel); a scan with another
fingerprint starts the layer's file afresh, with a notice. Records are keyed by
``(earlier, later)`` iterations, so a rerun with another ``--every`` reuses the pairs it shares.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Optional

from mechmon_megatron.scan.pairs import PairRecord

logger = logging.getLogger(__name__)

__all__ = ["PairCache", "fingerprint"]

CACHE_VERSION = 1


def fingerprint(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class PairCache:
    """The cached records of one layer; ``add`` appends durably."""

    def __init__(self, directory: str, layer: int, key: str) -> None:
        self.path = os.path.join(directory, f"layer_{layer:04d}.jsonl")
        self._key = key
        self.records: dict[tuple[int, int], PairRecord] = {}
        self._file: Optional[Any] = None
        self._load()

    def _load(self) -> None:
        if not os.path.isfile(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        try:
            header = json.loads(lines[0])
        except ValueError:
            header = {}
        if header.get("version") != CACHE_VERSION or header.get("fingerprint") != self._key:
            logger.warning("%s: cached by a scan of other checkpoints or settings; recomputing this layer", self.path)
            os.remove(self.path)
            return
        for line in lines[1:]:
            if not line.strip():
                continue
            try:
                record = PairRecord.from_json(json.loads(line))
            except (ValueError, TypeError):
                break  # a line cut short by an interruption: everything before it is complete
            self.records[(record.earlier, record.later)] = record

    def get(self, earlier: int, later: int) -> Optional[PairRecord]:
        return self.records.get((earlier, later))

    def add(self, record: PairRecord) -> None:
        if self._file is None:
            fresh = not os.path.isfile(self.path)
            if not fresh:
                self._rewrite_clean()
            self._file = open(self.path, "a", encoding="utf-8")
            if fresh:
                self._file.write(json.dumps({"version": CACHE_VERSION, "fingerprint": self._key}) + "\n")
        self._file.write(json.dumps(record.to_json()) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[(record.earlier, record.later)] = record

    def _rewrite_clean(self) -> None:
        """Drop a torn last line before appending (write a clean copy, then rename over)."""
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"version": CACHE_VERSION, "fingerprint": self._key}) + "\n")
            for record in self.records.values():
                f.write(json.dumps(record.to_json()) + "\n")
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
