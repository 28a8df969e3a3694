"""Healthy runs in, one check series per run out: what a path on the command line may be.

A path is any of

* a run's ``--mechmon-log-dir`` folder (it holds ``mechmon_scalars.jsonl``),
* the run folder above it, ``RUN/mechmon/mechmon_scalars.jsonl`` (the example trainer's layout),
* the ``mechmon_scalars.jsonl`` file itself,
* a record exported by the detector study (``<run_id>.json.gz``),
* a run's TensorBoard folder (``events.out.tfevents.*`` with ``mechmon/...`` scalars), or one
  event file.

A folder is read in that order of preference: the JSONL records (exact values, run numbers)
before TensorBoard events (float32 values). One path may hold several runs: fresh starts appended
to one records file (or written into one TensorBoard folder) are runs of their own, a resume
continues its run (``records.read_jsonl_runs``, ``tensorboard_events.read_event_runs``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Optional

from mechmon_megatron.calibrate.errors import CalibrationError
from mechmon_megatron.calibrate.records import Run, read_jsonl_runs, read_record_checks
from mechmon_megatron.calibrate.tensorboard_events import event_files, read_event_runs

__all__ = ["RECORD_SUFFIX", "RUN_SUBDIR", "SCALARS_FILE", "Source", "load_checks", "load_named_runs", "load_runs",
           "resolve", "run_name"]

SCALARS_FILE = "mechmon_scalars.jsonl"
"""The session's JSONL records in ``--mechmon-log-dir``."""
RUN_SUBDIR = "mechmon"
"""Where the example trainer's runs keep their log dir: ``RUN/mechmon``."""
RECORD_SUFFIX = ".json.gz"


@dataclass(frozen=True, slots=True)
class Source:
    """What one command-line path resolves to."""

    path: str
    """The file or folder that is read."""
    kind: Literal["jsonl", "record", "tensorboard", "event_file"]


def resolve(path: str) -> Source:
    """The records behind ``path`` (see the module docstring); :class:`CalibrationError` naming the
    path when it does not exist or is a folder without records."""
    if not os.path.exists(path):
        raise CalibrationError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        for candidate in (os.path.join(path, SCALARS_FILE), os.path.join(path, RUN_SUBDIR, SCALARS_FILE)):
            if os.path.isfile(candidate):
                return Source(candidate, "jsonl")
        if event_files(path):
            return Source(path, "tensorboard")
        raise CalibrationError(
            f"{path}: no {SCALARS_FILE}, {RUN_SUBDIR}/{SCALARS_FILE} or TensorBoard event files in this folder "
            "(pass a run's --mechmon-log-dir, the run folder above it, its TensorBoard folder, or the file)")
    name = os.path.basename(path)
    if name.endswith(RECORD_SUFFIX):
        return Source(path, "record")
    if name.startswith("events.out.tfevents."):
        return Source(path, "event_file")
    return Source(path, "jsonl")


def load_runs(path: str) -> list[Run]:
    """The recorded checks of each run in ``path`` (see the module docstring), each sorted by step;
    a :class:`CalibrationError` (a ``ValueError``) names the path when it holds none.

    A records file holds one run per fresh start into its log dir (the rows' ``run`` numbers,
    ``session/runs.py``); a resume, or a relaunch by ``mechmon-supervise`` after a rollback,
    continues its run, whose repeated iterations stay in it (sorted by step, duplicates kept, as
    a file of one run always loaded). A file without run numbers is one run."""
    source = resolve(path)
    if source.kind == "record":
        return [read_record_checks(source.path)]
    if source.kind == "tensorboard":
        return read_event_runs(source.path, event_files(source.path))
    if source.kind == "event_file":
        return read_event_runs(source.path, [source.path])
    return read_jsonl_runs(source.path)


def load_checks(path: str) -> Run:
    """The recorded checks of the one run in ``path`` (see :func:`load_runs`), sorted by step;
    ValueError when the file holds several runs (fresh starts into one log dir): a series that
    joined them would read the second start as a change inside one run."""
    runs = load_runs(path)
    if len(runs) > 1:
        raise ValueError(f"{path}: holds {len(runs)} runs (fresh starts into one --mechmon-log-dir); read them "
                         "one by one with load_runs")
    return runs[0]


def run_name(path: str) -> str:
    """A run's name in reports: the folder the user named (the run folder above a ``mechmon`` log
    dir), the folder of a records or event file, or a record's file name without ``.json.gz``."""
    full = os.path.normpath(os.path.abspath(path))
    if os.path.isfile(full) and not full.endswith(RECORD_SUFFIX):
        full = os.path.dirname(full)
    if os.path.basename(full) == RUN_SUBDIR:
        full = os.path.dirname(full)
    return os.path.basename(full).removesuffix(RECORD_SUFFIX)


def load_named_runs(paths: Sequence[str],
                    name_of: Optional[Callable[[str], str]] = None) -> tuple[list[Run], list[str]]:
    """Every run of every path, and a name for each: the path's name (``name_of``, default its
    base name), with ``#run K`` when its file holds several runs."""
    series: list[Run] = []
    names: list[str] = []
    for path in paths:
        name = name_of(path) if name_of is not None else os.path.basename(os.path.normpath(path))
        runs = load_runs(path)
        for k, run in enumerate(runs, start=1):
            series.append(run)
            names.append(name if len(runs) == 1 else f"{name}#run{k}")
    return series, names
