"""Read a detector-study campaign back: each run's record, forks joined to their parents.

A fault run forked from a healthy run at ``fork_at = onset - delta`` is bit-identical to its
parent before ``onset`` (tested), so its record is the parent's steps and checks before
``onset`` followed by its own from ``onset`` on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from mechmon_megatron.research.study.analysis import RunData, read_jsonl
from mechmon_megatron.research.study.campaign import SCALARS_FILE, read_status, run_dir
from mechmon_megatron.research.study.long_plan import CampaignRun, plan_campaign
from mechmon_megatron.research.study.scenarios import MECHMON_DIR, METRICS_FILE
from mechmon_megatron.session.runs import split_runs


@dataclass
class CampaignRecord:
    run: CampaignRun
    data: RunData
    status: dict

    @property
    def healthy(self) -> bool:
        return self.run.kind == "healthy"


def _rows(directory: str) -> tuple[list[dict], list[dict]]:
    return (
        read_jsonl(os.path.join(directory, METRICS_FILE)),
        read_jsonl(os.path.join(directory, MECHMON_DIR, SCALARS_FILE)),
    )


def joined_rows(out_dir: str, run: CampaignRun) -> tuple[list[dict], list[dict]]:
    """Metrics and check rows of ``run``, its parent's before the onset for a fork."""
    metrics, checks = _rows(run_dir(out_dir, run))
    if run.parent is None:
        return metrics, checks
    parent_metrics, parent_checks = _rows(os.path.join(out_dir, "runs", run.parent))
    onset = run.fault_onset
    metrics = [r for r in parent_metrics if int(r["iteration"]) < onset] + [
        r for r in metrics if int(r["iteration"]) >= onset
    ]
    checks = [r for r in parent_checks if int(r["step"]) < onset] + [r for r in checks if int(r["step"]) >= onset]
    return metrics, checks


def load_campaign(out_dir: str, runs: Optional[list[CampaignRun]] = None) -> dict[str, CampaignRecord]:
    """Every run of the plan that has a directory (finished or not), by run id."""
    out = {}
    for run in runs or plan_campaign():
        directory = run_dir(out_dir, run)
        if not os.path.isdir(directory):
            continue
        metrics, checks = joined_rows(out_dir, run)
        out[run.run_id] = CampaignRecord(
            run=run, data=RunData.from_rows(metrics, checks), status=read_status(directory)
        )
    return out


def scalars_path(path: str) -> str:
    """``path/mechmon/mechmon_scalars.jsonl`` for a run directory, or ``path`` itself."""
    candidate = os.path.join(path, MECHMON_DIR, SCALARS_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise FileNotFoundError(
            f"{path}: no {MECHMON_DIR}/{SCALARS_FILE} (expected a run directory or the file itself)"
        )
    return candidate


def load_runs(path: str) -> list[list[tuple[int, dict[str, float]]]]:
    """The recorded checks of each run in ``path`` (a run directory, its ``mechmon_scalars.jsonl``,
    or a record exported by ``tools/detector_study.py export``, ``*.json.gz``), each sorted by step;
    FileNotFoundError / ValueError name the path.

    A records file holds one run per fresh start into its log dir (the rows' ``run`` numbers,
    ``session/runs.py``); a resume, or a relaunch by ``mechmon-supervise`` after a rollback,
    continues its run, whose repeated iterations stay in it (sorted by step, duplicates kept, as
    a file of one run always loaded). A file without run numbers is one run."""
    if path.endswith(".json.gz") and os.path.isfile(path):
        from mechmon_megatron.research.study.campaign_records import load_record  # it imports this module

        return [load_record(path).data.checks]
    rows = read_jsonl(scalars_path(path))
    if not rows:
        raise ValueError(f"{path}: no checks recorded")
    return [RunData.from_rows([], run).checks for run in split_runs(rows)]


def load_checks(path: str) -> list[tuple[int, dict[str, float]]]:
    """The recorded checks of the one run in ``path`` (see :func:`load_runs`), sorted by step;
    ValueError when the file holds several runs (fresh starts appended to one log dir): a series
    that joined them would read the second start as a change inside one run."""
    runs = load_runs(path)
    if len(runs) > 1:
        raise ValueError(f"{path}: holds {len(runs)} runs (fresh starts into one --mechmon-log-dir); read them "
                         "one by one with load_runs")
    return runs[0]


def load_named_runs(paths: list[str], name_of=None) -> tuple[list[list[tuple[int, dict[str, float]]]], list[str]]:
    """Every run of every path, and a name for each: the path's name (``name_of``, default its
    base name), with ``#run K`` when its file holds several runs."""
    series: list[list[tuple[int, dict[str, float]]]] = []
    names: list[str] = []
    for path in paths:
        name = name_of(path) if name_of is not None else os.path.basename(os.path.normpath(path))
        runs = load_runs(path)
        for k, run in enumerate(runs, start=1):
            series.append(run)
            names.append(name if len(runs) == 1 else f"{name}#run{k}")
    return series, names
