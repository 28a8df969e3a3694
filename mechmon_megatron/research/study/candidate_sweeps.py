"""Delay against false-alarm rate for issue 19's candidate families beside the shipped ones and the
symptom rules, on the short-window campaign's records (docs/RESULTS.md, "Delay against
false-alarm rate with the candidate families").

Curves: the shipped families Δ2 and dW; Δ2 over the short window (round 5); the persistence of
Δ2's leading direction (round 8); the max attention logit rule, the W_q spectral norm and loss
2x-mean. Each mechmon family is swept over R (``detector_report.RATE_GRID``) inside the design
that has it, with the tails rounds 5 and 8 fit (``calibrate_short`` on this campaign's seeds 1-2):
``long+short`` (25 tests) for the first three, ``long+persist`` (25 tests) for the persistence.
A curve's x is its own family's healthy alarm episodes per 10^6 healthy steps; its y the median
delay over a fault group's runs (a miss counts as the longest run of the group). Interval 20 only.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any, Optional

from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.detector_report import (
    RuleSweep,
    fault_group,
    mechmon_sweep,
    operating_index,
    symptom_sweeps,
)
from mechmon_megatron.research.study.persistence_study import persistence_records
from mechmon_megatron.research.study.pooled_replay import CORE_FAMILIES
from mechmon_megatron.research.study.short_window_study import SHORT, calibrate_short

PERSISTENCE = "mechmon attn_persistence"
CURVES: tuple[str, ...] = ("mechmon attn_delta2", "mechmon attn_dw", f"mechmon {SHORT}", PERSISTENCE,
                           "max_attn_logit", "wq_spectral_norm", "loss_2x_mean")


def group_of(record: CampaignRecord) -> str:
    """The study's fault group, with the fault confined to some layers kept apart."""
    group = fault_group(record)
    return f"{group}, layer 2 only" if "-layers2-" in record.run.run_id else group


def candidate_sweeps(records: Mapping[str, CampaignRecord]) -> dict[str, Any]:
    """The sweeps of :data:`CURVES` and what :func:`detector_plots.plot_delay_vs_far` reads."""
    table, _ = calibrate_short(records)
    long_short, _ = mechmon_sweep(records, table, families=(*CORE_FAMILIES, SHORT))
    moved = persistence_records(records)
    persist, _ = mechmon_sweep(moved, calibrate_short(moved)[0], families=(SHORT,))
    sweeps: dict[str, RuleSweep] = {f"mechmon {f}": s for f, s in long_short.items()}
    sweeps[PERSISTENCE] = persist[SHORT]
    sweeps.update(symptom_sweeps(records))
    runs = {run_id: {"kind": r.run.kind, "group": None if r.healthy else group_of(r), "onset": r.run.fault_onset,
                     "steps": r.data.steps[-1] if r.data.steps else 0} for run_id, r in records.items()}
    return {
        "healthy_steps": sum(r.data.steps[-1] for r in records.values() if r.healthy and r.data.steps),
        "runs": runs,
        "sweeps": {name: {"thresholds": list(s.thresholds), "healthy_episodes": s.healthy_episodes,
                          "first_alarm": s.first_alarm} for name, s in sweeps.items() if name in CURVES},
    }


def median_delay_at_zero(results: Mapping[str, Any]) -> dict[str, dict[str, Optional[float]]]:
    """Per curve and fault group: the median delay at the curve's most sensitive setting with no
    healthy alarm (None: no setting is quiet); a miss counts as the group's longest run."""
    runs = results["runs"]
    groups: dict[str, list[str]] = {}
    for run_id, r in runs.items():
        if r["kind"] != "healthy":
            groups.setdefault(r["group"], []).append(run_id)
    out: dict[str, dict[str, Optional[float]]] = {}
    for name in CURVES:
        sweep = results["sweeps"].get(name)
        if sweep is None:
            continue
        idx = operating_index(RuleSweep(name, sweep["thresholds"], sweep["healthy_episodes"], sweep["first_alarm"]),
                              results["healthy_steps"], None)
        out[name] = {}
        for group, members in sorted(groups.items()):
            if idx is None:
                out[name][group] = None
                continue
            cap = max(runs[m]["steps"] - (runs[m]["onset"] or 0) for m in members)
            firsts = sweep["first_alarm"][idx]
            out[name][group] = statistics.median(
                cap if firsts.get(m) is None else firsts[m] - (runs[m]["onset"] or 0) for m in members)
    return out


def markdown(results: Mapping[str, Any]) -> str:
    """The table of median delays at zero observed healthy alarms (rows: curves, columns: groups)."""
    table = median_delay_at_zero(results)
    groups = sorted({g for row in table.values() for g in row})
    lines = ["| curve | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for name, row in table.items():
        cells = ["never quiet" if row.get(g) is None else f"{row[g]:.0f}" for g in groups]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
