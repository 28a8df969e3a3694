"""Read recorded checks back from a run's TensorBoard event files (``mechmon/...`` scalars).

The session writes every check's scalars to TensorBoard (the host's writer, or its own in
``--mechmon-log-dir``) under ``mechmon/`` tags at step = the check's iteration: the same names
and steps as ``mechmon_scalars.jsonl``. TensorBoard stores each value as a 32-bit float, so a fit
from events equals the fit from the JSONL records with their values rounded to float32 (close to,
not bit-identical with, the fit from the JSONL file itself: prefer the file when there is one).

Each launch writes its own event file. The files are read one by one, in the order they were
started (their first event's wall time), and grouped into runs the way the JSONL records number
them: a launch whose first check is no later than the current run's first check started from
scratch (a fresh start into the same folder) and begins a new run; any other launch (a resume from
a checkpoint, a relaunch after a rollback) continues the current run, its repeated steps kept.
Event files without ``mechmon/`` scalars (the trainer's own) are skipped.

Needs the ``tensorboard`` package (``pip install 'mechmon-megatron[calibrate]'``), imported when
a folder of events is read.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

from mechmon_megatron.calibrate.errors import CalibrationError
from mechmon_megatron.calibrate.records import Run
from mechmon_megatron.session import names

__all__ = ["EVENT_FILE_GLOB", "event_files", "read_event_runs"]

EVENT_FILE_GLOB = "events.out.tfevents.*"
_TAG_PREFIX = names.PREFIX + "/"


def event_files(folder: str) -> list[str]:
    """The TensorBoard event files directly in ``folder`` (not in sub-folders)."""
    return sorted(p for p in glob.glob(os.path.join(glob.escape(folder), EVENT_FILE_GLOB)) if os.path.isfile(p))


def _accumulator_class():
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise CalibrationError("reading TensorBoard events needs the `tensorboard` package: "
                               "pip install 'mechmon-megatron[calibrate]' (or pass the run's "
                               "mechmon_scalars.jsonl)") from None
    return EventAccumulator


def _read_file(path: str) -> tuple[float, Run]:
    """(wall time of the file's first event, its mechmon checks sorted by step)."""
    accumulator = _accumulator_class()(path, size_guidance={"scalars": 0}, purge_orphaned_data=False)
    try:
        accumulator.Reload()  # size_guidance 0: every event (the default keeps a sample per tag)
        first = accumulator.FirstEventTimestamp()
    except Exception as exc:  # noqa: BLE001 -- the reader raises its own and protobuf's errors
        raise CalibrationError(f"{path}: not a readable TensorBoard event file ({type(exc).__name__}: {exc})") \
            from None
    by_step: dict[int, dict[str, float]] = {}
    for tag in accumulator.Tags().get("scalars", []):
        if tag.startswith(_TAG_PREFIX):
            for event in accumulator.Scalars(tag):
                by_step.setdefault(int(event.step), {})[tag] = float(event.value)
    return first, sorted(by_step.items())


def read_event_runs(where: str, files: Sequence[str]) -> list[Run]:
    """The runs recorded in the event ``files`` (those of one folder, see the module docstring),
    each sorted by step; a :class:`CalibrationError` naming ``where`` (the folder or file the user
    passed) when none holds ``mechmon/`` scalars."""
    launches = sorted((_read_file(path) for path in files), key=lambda item: item[0])
    runs: list[Run] = []
    for _, checks in launches:
        if not checks:
            continue
        if runs and checks[0][0] > runs[-1][0][0]:
            runs[-1] = sorted(runs[-1] + checks, key=lambda check: check[0])  # stable: repeats keep order
        else:
            runs.append(checks)
    if not runs:
        raise CalibrationError(f"{where}: its TensorBoard event files hold no {_TAG_PREFIX}... scalars "
                               "(was the run monitored with --mechmon?)")
    return runs
