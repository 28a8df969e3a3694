"""Read a detector-study campaign back: each run's record, forks joined to their parents.

A fault run forked from a healthy run at ``fork_at = onset - delta`` is bit-identical to its
parent before ``onset`` (tested), so its record is the parent's steps and checks before
``onset`` followed by its own from ``onset`` on.

The loader of recorded checks (``load_runs``, ``load_checks``, ``load_named_runs``: a run folder,
its ``mechmon_scalars.jsonl``, an exported ``.json.gz`` record, a TensorBoard folder) lives in the
product (``mechmon_megatron.calibrate.inputs``, what ``mechmon-calibrate`` reads); the studies
import it from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from mechmon_megatron.calibrate.inputs import load_checks, load_named_runs, load_runs
from mechmon_megatron.research.study.analysis import RunData, read_jsonl
from mechmon_megatron.research.study.campaign import SCALARS_FILE, read_status, run_dir
from mechmon_megatron.research.study.long_plan import CampaignRun, plan_campaign
from mechmon_megatron.research.study.scenarios import MECHMON_DIR, METRICS_FILE

__all__ = ["CampaignRecord", "joined_rows", "load_campaign", "load_checks", "load_named_runs", "load_runs"]


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
