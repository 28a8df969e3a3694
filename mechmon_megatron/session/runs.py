"""Runs in one records file: which launch's rows belong to which training run.

A ``--mechmon-log-dir`` may see several launches: a resume (``--load``, a relaunch by
``mechmon-supervise`` after a rollback) continues the run it resumes, while a fresh start (no
monitor state loaded) into a folder whose ``mechmon_scalars.jsonl`` already holds records is a
different training run. Calibration and replays must not read the two as one series.

The records file keeps its format, one ``{"step", "scalars"}`` object per check, because many
readers (yours, the studies', ``mechmon-scan``'s inputs) parse it row by row; each row only gains
a ``"run"`` number (:data:`RUN_KEY`). Each launch also appends one marker record (:class:`RunMarker`:
run number and id, start iteration, whether it resumed monitor state, interval and delta) to
:data:`RUNS_FILE` beside it. A fresh start takes the number after the last row's; a resume keeps
it. Rows without the key (files written before run numbers) belong to run 1, so an old file loads
exactly as before. :func:`split_runs` is the reader's side.

Standard library only.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["RUNS_FILE", "RUN_KEY", "RunMarker", "last_record", "new_run_id", "run_of", "split_runs", "utc_now"]

RUN_KEY = "run"
"""Key of the run number in each records row (absent: run 1)."""

RUNS_FILE = "mechmon_runs.jsonl"
"""The launch markers, one JSON object per launch, beside the records file."""

_TAIL_BLOCK = 1 << 16


@dataclass(frozen=True)
class RunMarker:
    """One launch as the records file's run markers keep it."""

    run: int
    """Run number of the rows this launch writes (1, 2, ...)."""
    run_id: str
    """Unique id of this launch."""
    start_iteration: int
    resumed: bool
    """The launch loaded monitor state from a checkpoint (a resume continues its run)."""
    interval: int
    delta: int
    started: str
    """Wall-clock start, ISO 8601 (UTC)."""
    previous_run: Optional[int] = None
    """The last run number in the file before this launch (None: the file held no records)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def new_run_id() -> str:
    """A short unique id for one launch."""
    return uuid.uuid4().hex[:12]


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def last_record(path: str) -> Optional[dict[str, Any]]:
    """The last complete row of a JSONL records file (None: no file, or no complete row).

    Reads backwards from the end in blocks, so a long file costs one block or a few; a torn last
    line (a killed run) is skipped, as every reader of the file skips it."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            tail = b""
            while end > 0:
                start = max(0, end - _TAIL_BLOCK)
                f.seek(start)
                tail = f.read(end - start) + tail
                end = start
                lines = tail.split(b"\n")
                # lines[0] may be cut by the block boundary unless the file's start was reached
                candidates = lines if end == 0 else lines[1:]
                for line in reversed(candidates):
                    row = _row(line)
                    if row is not None:
                        return row
                if end > 0:
                    tail = lines[0]  # keep the cut line for the next, earlier block
    except FileNotFoundError:
        return None
    return None


def _row(line: bytes) -> Optional[dict[str, Any]]:
    line = line.strip()
    if not line:
        return None
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) and "step" in row else None


def run_of(row: Mapping[str, Any]) -> int:
    """A row's run number (1 for rows written before run numbers)."""
    value = row.get(RUN_KEY)
    return 1 if value is None else int(value)


def split_runs(rows: Iterable[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The rows of one records file, one list per run, in the order the runs first appear.

    Rows of one run keep their file order: a resume after a rollback repeats iterations inside
    its run, exactly as a file of one run always did (readers sort by step, duplicates kept)."""
    runs: dict[int, list[Mapping[str, Any]]] = {}
    for row in rows:
        runs.setdefault(run_of(row), []).append(row)
    return list(runs.values())
