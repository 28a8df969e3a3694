"""Read recorded checks from the two JSON forms: ``mechmon_scalars.jsonl`` and an exported record.

``mechmon_scalars.jsonl`` (the session's JSONL writer, ``session/writers.py``) holds one object
per check, ``{"step": t, "scalars": {name: value}, "run": k}``; ``run`` numbers the fresh starts
into one log dir (``session/runs.py``). An exported record (``<run_id>.json.gz``, written by the
detector study's ``export_records``) is one gzipped JSON object ``{"version": 1, "checks": [...],
...}`` whose ``checks`` are rows of the same form. Values are read as Python floats (``null`` ->
NaN), so a replay of either equals a replay of the run.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from mechmon_megatron.calibrate.errors import CalibrationError
from mechmon_megatron.session.runs import split_runs

__all__ = ["RECORD_VERSION", "Run", "checks_from_rows", "read_jsonl_runs", "read_record_checks"]

RECORD_VERSION = 1
"""Format version of an exported ``.json.gz`` record (the detector study writes the same number)."""

Run = list[tuple[int, dict[str, float]]]
"""One run's checks, ``(step, {scalar name: value})``, sorted by step (a resume's repeats kept)."""

_EXPECTED = ('expected mechmon_scalars.jsonl rows {"step": ..., "scalars": {...}} as the session writes them '
             "with --mechmon-log-dir")


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def checks_from_rows(rows: Iterable[Mapping[str, Any]]) -> Run:
    """Rows ``{"step", "scalars"}`` -> checks sorted by step (a stable sort: repeats keep file order)."""
    return [(int(row["step"]), {k: _num(v) for k, v in row["scalars"].items()})
            for row in sorted(rows, key=lambda r: int(r["step"]))]


def _is_check_row(row: Any) -> bool:
    if not (isinstance(row, dict) and isinstance(row.get("scalars"), dict)):
        return False
    try:
        int(row["step"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


def _checks(rows: list[Any], path: str) -> Run:
    bad = next((i for i, row in enumerate(rows) if not _is_check_row(row)), None)
    if bad is not None:
        raise CalibrationError(f"{path}: row {bad + 1} is not a mechmon check ({_EXPECTED})")
    try:
        return checks_from_rows(rows)
    except (TypeError, ValueError) as exc:
        raise CalibrationError(f"{path}: a check holds a value that is not a number ({exc})") from None


def jsonl_rows(lines: Iterable[str]) -> list[Any]:
    """The JSON values of the non-empty lines; a line that is not JSON (the torn last line of a run
    still writing) is skipped."""
    rows: list[Any] = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_jsonl_runs(path: str) -> list[Run]:
    """The runs of one ``mechmon_scalars.jsonl``, in the order they first appear, each sorted by step.

    A line that is not JSON is skipped (the torn last line of a run still writing, as every reader
    of the file skips it); a JSON line that is not a check row, or a file without any check, is a
    :class:`CalibrationError` naming the file. A fresh start appended to the file is a run of its
    own; a resume (and a relaunch after a rollback) continues its run, repeats kept
    (``session.runs.split_runs``). Rows without run numbers are one run."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = jsonl_rows(f)
    except UnicodeDecodeError:
        raise CalibrationError(f"{path}: not a text file ({_EXPECTED})") from None
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not rows:
        raise CalibrationError(f"{path}: no checks recorded ({_EXPECTED})")
    if not all(isinstance(row, dict) for row in rows):
        raise CalibrationError(f"{path}: not a mechmon records file ({_EXPECTED})")
    return [_checks(run, path) for run in split_runs(rows)]


def read_record_checks(path: str) -> Run:
    """The checks of one exported record (``<run_id>.json.gz``, one run), sorted by step.

    A truncated or corrupt file, a gzipped JSON that is no record, or a record of another version
    is a :class:`CalibrationError` naming the file."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{path}: not a readable gzipped JSON record ({type(exc).__name__}: {exc}); "
                               "a truncated or corrupt file? Export it again") from None
    if not (isinstance(body, dict) and "version" in body and isinstance(body.get("checks"), list)):
        raise CalibrationError(f"{path}: not a mechmon record (a gzipped JSON object with 'version' and "
                               "'checks', as the detector study exports runs)")
    if body["version"] != RECORD_VERSION:
        raise CalibrationError(f"{path}: record version {body['version']!r}, expected {RECORD_VERSION}")
    if not body["checks"]:
        raise CalibrationError(f"{path}: no checks recorded")
    return _checks(body["checks"], path)
