"""The frontier-attention fault study's report (docs/METHOD.md section 8b): the shipped detector on
each variant's runs, as pre-registered.

* healthy runs: the shipped detector replayed at interval 20 (alarms, closest approach to a warning
  level; ``shipped_replay.replay_shipped``), with the steps each run has trained so far;
* fault runs: first alarm after the onset, its family and layers, the Δ2 and dW firsts, the
  max-logit rule at its most sensitive threshold quiet on the variant's healthy runs, the lead
  before the loss divergence (``shipped_replay.fault_row``), and a router-family alarm and no
  attention alarm for the router-only LR fault;
* MLA only, secondary: the same fault table with the whole Δ2 stream (no-RoPE and RoPE rows) in
  place of the content stream, the detector otherwise unchanged.

Reads a live campaign folder (``runs/frontier_mla``: finished and unfinished runs alike) or an
exported records folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any, Optional

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.research.study.campaign_data import CampaignRecord, load_campaign
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.frontier_plan import plan_frontier_campaign
from mechmon_megatron.research.study.shipped_replay import (
    RECORDED_INTERVAL,
    fault_markdown,
    fault_row,
    logit_rule_threshold,
    markdown,
    replay_shipped,
)

CONTENT = "mechmon/attn/delta2_entropy/"
WHOLE = "mechmon/attn/delta2_whole_entropy/"


def load_frontier(path: str, variant: str) -> dict[str, CampaignRecord]:
    """The variant's runs from a campaign folder (with ``runs/``) or an exported records folder."""
    if os.path.isdir(os.path.join(path, "runs")):
        return load_campaign(path, plan_frontier_campaign(variant))
    return load_records(path)


def whole_stream_view(record: CampaignRecord) -> CampaignRecord:
    """``record`` with each check's MLA whole-stream scalars in place of the content stream's, so
    that the detector's Δ2 family reads the whole stream (layer means and per-head values)."""
    checks = []
    for step, scalars in record.data.checks:
        out = {k: v for k, v in scalars.items() if not k.startswith(CONTENT)}
        out.update({CONTENT + k[len(WHOLE):]: v for k, v in scalars.items() if k.startswith(WHOLE)})
        checks.append((step, out))
    return replace(record, data=replace(record.data, checks=checks))


def _first_after_onset(record: CampaignRecord, rate: float) -> Optional[dict[str, Any]]:
    onset = record.run.fault_onset or 0
    alarms = replay_shipped(record, RECORDED_INTERVAL, rate).alarms
    return next((a for a in alarms if a["step"] >= onset), None)


def fault_table(records: Mapping[str, CampaignRecord], rule_threshold: Optional[float],
                rate: float = DEFAULT_FALSE_ALARM_RATE) -> tuple[str, list[dict[str, Any]]]:
    """Markdown and rows of the fault runs (FA and router-only LR), with the first alarm's layers."""
    rows = []
    for run_id in sorted(k for k, r in records.items() if not r.healthy):
        record = records[run_id]
        row = asdict(fault_row(record, rule_threshold, rate))
        first = _first_after_onset(record, rate)
        row["first_layers"] = [] if first is None else list(first["layers"])
        row["steps_trained"] = record.data.steps[-1] if record.data.steps else 0
        row["finished"] = record.status.get("state") in ("done", "stopped-after-divergence")
        rows.append(row)
    table = fault_markdown([_as_fault_row(r) for r in rows], rule_threshold)
    extra = ["", "| run | steps trained | finished | first alarm's layers |", "|---|---|---|---|"]
    extra += [f"| {r['run_id']} | {r['steps_trained']} | {'yes' if r['finished'] else 'no'} | "
              f"{', '.join(f'L{x}' for x in r['first_layers']) or '-'} |" for r in rows]
    return table + "\n" + "\n".join(extra), rows


def _as_fault_row(row: Mapping[str, Any]):
    from mechmon_megatron.research.study.shipped_replay import FaultRow

    return FaultRow(**{k: row[k] for k in FaultRow.__dataclass_fields__})


def frontier_report(path: str, variant: str, rate: float = DEFAULT_FALSE_ALARM_RATE) -> tuple[str, dict[str, Any]]:
    """The variant's report: markdown and a JSON-ready dict."""
    records = load_frontier(path, variant)
    healthy = {k: r for k, r in records.items() if r.healthy}
    threshold = logit_rule_threshold(records) if healthy else None
    replays = [replay_shipped(healthy[k], RECORDED_INTERVAL, rate) for k in sorted(healthy)]
    steps = {k: (r.data.steps[-1] if r.data.steps else 0) for k, r in healthy.items()}
    faults_md, fault_rows = fault_table(records, threshold, rate)
    parts = [f"# Frontier attention: {variant}", "",
             "## Healthy runs (shipped detector, interval 20)", "",
             "Steps trained: " + ", ".join(f"{k} {v}" for k, v in sorted(steps.items())), "",
             markdown(replays) if replays else "(none yet)", "",
             "## Fault runs (shipped detector, interval 20; content stream for MLA)", "", faults_md]
    data: dict[str, Any] = {"variant": variant, "rate": rate, "max_logit_rule_threshold": threshold,
                            "healthy": [asdict(r) for r in replays], "healthy_steps": steps, "faults": fault_rows}
    if variant == "mla":
        whole = {k: whole_stream_view(r) for k, r in records.items()}
        whole_md, whole_rows = fault_table({k: r for k, r in whole.items()}, threshold, rate)
        whole_healthy = [replay_shipped(whole[k], RECORDED_INTERVAL, rate) for k in sorted(healthy)]
        parts += ["", "## MLA, secondary: the whole Δ2 stream in place of the content stream", "",
                  markdown(whole_healthy) if whole_healthy else "(no healthy runs yet)", "", whole_md]
        data["whole_stream"] = {"healthy": [asdict(r) for r in whole_healthy], "faults": whole_rows}
    return "\n".join(parts) + "\n", data
