"""Analysis of the detector study: calibration, healthy-run alarms, equal-false-alarm comparison.

Inputs: a campaign directory written by ``tools/detector_study.py run``. Outputs under
``OUT/analysis/``: ``null_tails.json`` (the fit on the calibration runs), ``results.json``,
``report.md`` and ``plots/*.png``.

1. **Calibration.** The null tails of the CUSUM statistics are fitted on the calibration runs
   only (:data:`CALIBRATION_RUNS`); every other healthy run is held out.
2. **Session default.** The thresholds of ``--mechmon-false-alarm-rate 0.01`` for this model
   (the study's schedule: checks every 20 steps over a 100-step window) are replayed on every
   run: alarms on healthy runs (the target is none), first alarms and leads on the faults.
3. **Equal false-alarm rate.** Each rule is swept over its threshold (mechmon families over the
   rate ``R``; the symptom rules over the grids of :mod:`~mechmon_megatron.research.study.rule_scores`).
   Its empirical false-alarm rate is its alarm episodes on all healthy runs per 10^6 healthy
   steps. At a common level (the most sensitive setting with no healthy alarm, then looser
   levels) each rule's detection delay on the faults is compared.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, TailTable
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.study import rule_scores
from mechmon_megatron.research.study.analysis import CollapseRule, DivergenceRule
from mechmon_megatron.research.study.campaign_data import CampaignRecord, load_campaign
from mechmon_megatron.research.study.long_plan import long_preset
from mechmon_megatron.research.study.pooled_replay import (
    CORE_FAMILIES as FAMILIES,
)
from mechmon_megatron.research.study.pooled_replay import (
    calibrate_on_runs,
    replay_pooled,
    subsample,
    thresholds_at_rate,
)

CALIBRATION_RUNS: tuple[str, ...] = ("healthy-cosine-seed1", "healthy-cosine-seed2")
INTERVAL = long_preset().mechmon_interval
"""The campaign's check interval (steps), from its plan."""
DELTA = long_preset().mechmon_delta
RATE_GRID: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4, 1e5)
FAR_LEVELS: tuple[Optional[float], ...] = (None, 100.0, 1000.0)
"""Comparison levels: None = no alarm on any healthy run; then <= 100 and <= 1000 per 10^6 steps."""
ATTN = ("attn_delta2", "attn_dw")


@dataclass
class RuleSweep:
    """One rule over its thresholds: healthy episodes and first alarms (at/after onset) per run."""

    rule: str
    thresholds: list[float]
    """In sensitivity order: most sensitive last."""
    healthy_episodes: list[int]
    first_alarm: list[dict[str, Optional[int]]]


def fault_group(record: CampaignRecord) -> str:
    run = record.run
    if run.scenario == "fa":
        return f"fa {int(run.fa_strength)} ulps, onset {run.fault_onset}"
    return {"moe-lr": "moe-lr (4x LR)", "moe-router-lr": "moe-router-lr (15x router LR)"}.get(
        run.scenario, run.scenario
    )


def _onset(record: CampaignRecord) -> int:
    return record.run.fault_onset or 0


# ------------------------------------------------------------------------------ calibration
def calibrate(
    records: Mapping[str, CampaignRecord], calibration: Sequence[str] = CALIBRATION_RUNS
) -> tuple[TailTable, dict[str, Any]]:
    """Tails at the native overlap (delta / interval) and at overlap 1 (every 5th check)."""
    missing = [r for r in calibration if r not in records]
    if missing:
        raise ValueError(f"calibration runs {missing} are missing from the campaign")
    series = [records[r].data.checks for r in calibration]
    table, log = calibrate_on_runs(
        series,
        INTERVAL,
        DELTA,
        source=f"healthy runs {', '.join(calibration)} of tools/detector_study.py (interval {INTERVAL}, delta {DELTA})",
    )
    return table, log


# ------------------------------------------------------------------------------ sweeps
def mechmon_sweep(
    records: Mapping[str, CampaignRecord], table: TailTable, every: int = 1, rates: Sequence[float] = RATE_GRID,
    families: Sequence[str] = FAMILIES,
) -> tuple[dict[str, RuleSweep], dict[str, Any]]:
    """Per family: the replay at every rate (rates ascending = more sensitive last). ``families``:
    the families swept (the records' other detector streams still feed the detector)."""
    sample = next(iter(records.values())).data.checks
    overlap = max(1, math.ceil(DELTA / (INTERVAL * every)))
    sweeps = {f: RuleSweep(f, list(rates), [], []) for f in families}
    alarms_at_default: dict[str, Any] = {}
    cost = {"checks": 0, "seconds": 0.0}
    for rate in rates:
        thresholds, _ = thresholds_at_rate(sample, INTERVAL * every, overlap, rate, table)
        episodes = {f: 0 for f in families}
        firsts: dict[str, dict[str, Optional[int]]] = {f: {} for f in families}
        for run_id, record in records.items():
            checks = subsample(record.data.checks, INTERVAL, every)
            start = time.perf_counter()
            replay = replay_pooled(
                checks, thresholds, default_sequential_config(INTERVAL * every), start_step=_onset(record)
            )
            cost["seconds"] += time.perf_counter() - start
            cost["checks"] += len(checks)
            if record.healthy:
                for alarm in replay.alarms:
                    if alarm.family in episodes:
                        episodes[alarm.family] += 1
            for f in families:
                firsts[f][run_id] = replay.first_alarm[f]
            if rate == DEFAULT_FALSE_ALARM_RATE:
                alarms_at_default[run_id] = [
                    {
                        "step": a.step,
                        "family": a.family,
                        "level": a.level,
                        "kind": a.kind,
                        "layers": list(a.layers),
                        "members": list(a.members),
                        "statistic": _finite(a.statistic),
                        "threshold": _finite(a.threshold),
                        "change_step": a.change_step,
                    }
                    for a in replay.alarms
                ]
        for f in families:
            sweeps[f].healthy_episodes.append(episodes[f])
            sweeps[f].first_alarm.append(firsts[f])
    return sweeps, {
        "alarms_at_default_rate": alarms_at_default,
        "detector_us_per_check": 1e6 * cost["seconds"] / max(1, cost["checks"]),
    }


def symptom_sweeps(records: Mapping[str, CampaignRecord]) -> dict[str, RuleSweep]:
    scores = {}
    for run_id, record in records.items():
        d = record.data
        wq = {n: d.series(n) for n in d.scalar_names() if n.startswith("mechmon/attn/wq_spectral_norm/")}
        scores[run_id] = rule_scores.rule_scores(d.steps, d.loss, d.grad_norm, d.max_attn_logit, wq)
    sweeps = {}
    for rule, grid in rule_scores.RULE_GRIDS.items():
        ordered = sorted(grid, reverse=True)  # larger threshold = less sensitive, first
        sweep = RuleSweep(rule, ordered, [], [])
        for threshold in ordered:
            episodes = 0
            firsts: dict[str, Optional[int]] = {}
            for run_id, record in records.items():
                series = scores[run_id].get(rule)
                if series is None:
                    firsts[run_id] = None
                    continue
                if record.healthy:
                    episodes += len(rule_scores.episodes(series, threshold))
                # An alarm episode that started before the onset and still runs is no detection:
                # the first episode that STARTS at or after the onset is.
                starts = [s for s in rule_scores.episodes(series, threshold) if s >= _onset(record)]
                firsts[run_id] = starts[0] if starts else None
            sweep.healthy_episodes.append(episodes)
            sweep.first_alarm.append(firsts)
        sweeps[rule] = sweep
    return sweeps


def operating_index(sweep: RuleSweep, healthy_steps: int, level: Optional[float]) -> Optional[int]:
    """Most sensitive setting whose healthy false-alarm rate is within ``level`` (None: zero)."""
    best = None
    for i, episodes in enumerate(sweep.healthy_episodes):
        far = 1e6 * episodes / max(1, healthy_steps)
        if (episodes == 0) if level is None else (far <= level):
            best = i
    return best


# ------------------------------------------------------------------------------ events
def events(record: CampaignRecord) -> dict[str, Optional[int]]:
    d = record.data
    return {"divergence": DivergenceRule().first_step(d.steps, d.loss), "collapse": CollapseRule().first_step(d.checks)}


def lead_share(alarm: Optional[int], divergence: Optional[int], onset: int) -> Optional[float]:
    if alarm is None or divergence is None or alarm > divergence or divergence <= onset:
        return None
    return (divergence - alarm) / (divergence - onset)


def _finite(x: float) -> Optional[float]:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _earliest(*steps: Optional[int]) -> Optional[int]:
    vals = [s for s in steps if s is not None]
    return min(vals) if vals else None


# ------------------------------------------------------------------------------ analysis
def analyze_campaign(out_dir: str, plots: bool = True, records_dir: Optional[str] = None,
                     analysis_dir: Optional[str] = None) -> dict[str, Any]:
    """Analyse a campaign directory, or the exported records in ``records_dir`` (then the
    outputs go to ``analysis_dir``, default ``OUT/analysis``)."""
    if records_dir is not None:
        from mechmon_megatron.research.study.campaign_records import load_records

        records = load_records(records_dir)
    else:
        records = load_campaign(out_dir)
    if not any(r.healthy for r in records.values()):
        raise SystemExit(f"no healthy runs under {records_dir or out_dir}: run `tools/detector_study.py run` first")
    analysis_dir = analysis_dir or os.path.join(out_dir, "analysis")
    os.makedirs(analysis_dir, exist_ok=True)
    table, fit_log = calibrate(records)
    with open(os.path.join(analysis_dir, "null_tails.json"), "w", encoding="utf-8") as f:
        json.dump(table.to_dict(), f, indent=1)
    healthy = {k: r for k, r in records.items() if r.healthy}
    healthy_steps = sum(r.data.steps[-1] for r in healthy.values() if r.data.steps)
    ev = {k: events(r) for k, r in records.items()}
    mech, mech_info = mechmon_sweep(records, table)
    mech_100, mech_100_info = mechmon_sweep(records, table, every=DELTA // INTERVAL)
    symptoms = symptom_sweeps(records)
    default_index = RATE_GRID.index(DEFAULT_FALSE_ALARM_RATE)

    def default_first(family: str, run_id: str, sweeps=mech) -> Optional[int]:
        return sweeps[family].first_alarm[default_index][run_id]

    runs_out = {}
    for run_id, record in records.items():
        onset = _onset(record)
        first = {f: default_first(f, run_id) for f in FAMILIES}
        attn = _earliest(*(first[f] for f in ATTN))
        runs_out[run_id] = {
            "kind": record.run.kind,
            "scenario": record.run.scenario,
            "seed": record.run.seed,
            "group": None if record.healthy else fault_group(record),
            "onset": record.run.fault_onset,
            "schedule": record.run.schedule,
            "fa_strength": record.run.fa_strength,
            "steps": record.data.steps[-1] if record.data.steps else 0,
            "status": record.status.get("state"),
            "calibration": run_id in CALIBRATION_RUNS,
            **ev[run_id],
            "first_alarm_default": first,
            "first_alarm_default_interval_100": {f: default_first(f, run_id, mech_100) for f in FAMILIES},
            "attention_alarm": attn,
            "attention_lead_share": lead_share(attn, ev[run_id]["divergence"], onset),
            "alarms_default": mech_info["alarms_at_default_rate"].get(run_id, []),
            "alarms_default_interval_100": mech_100_info["alarms_at_default_rate"].get(run_id, []),
        }
    all_sweeps = {**{f"mechmon {f}": s for f, s in mech.items()}, **symptoms}
    comparison = {}
    for level in FAR_LEVELS:
        key = "zero" if level is None else f"<= {level:g}"
        comparison[key] = {}
        for name, sweep in all_sweeps.items():
            idx = operating_index(sweep, healthy_steps, level)
            comparison[key][name] = (
                None
                if idx is None
                else {
                    "threshold": sweep.thresholds[idx],
                    "healthy_far_per_million": 1e6 * sweep.healthy_episodes[idx] / healthy_steps,
                    "first_alarm": sweep.first_alarm[idx],
                }
            )
    results = {
        "healthy_steps": healthy_steps,
        "calibration_runs": list(CALIBRATION_RUNS),
        "fit": fit_log,
        "rate_grid": list(RATE_GRID),
        "default_rate": DEFAULT_FALSE_ALARM_RATE,
        "detector_us_per_check": mech_info["detector_us_per_check"],
        "runs": runs_out,
        "sweeps": {
            name: {"thresholds": s.thresholds, "healthy_episodes": s.healthy_episodes, "first_alarm": s.first_alarm}
            for name, s in all_sweeps.items()
        },
        "comparison": comparison,
    }
    results["targets"] = targets(results)
    with open(os.path.join(analysis_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    from mechmon_megatron.research.study.detector_markdown import markdown_detector_report

    report = markdown_detector_report(results)
    with open(os.path.join(analysis_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(report)
    if plots:
        from mechmon_megatron.research.study.detector_plots import plot_delay_vs_far, plot_null_tails

        plot_delay_vs_far(results, os.path.join(analysis_dir, "plots"))
        plot_null_tails(records, table, CALIBRATION_RUNS, os.path.join(analysis_dir, "plots"))
    print(report)
    return results


def targets(results: Mapping[str, Any]) -> dict[str, Any]:
    """Every target of the detector study, measured (met or not)."""
    runs = results["runs"]
    healthy = {k: v for k, v in runs.items() if v["kind"] == "healthy"}
    healthy_alarms = {k: len(v["alarms_default"]) for k, v in healthy.items()}
    fa = {k: v for k, v in runs.items() if v["scenario"] == "fa" and v["fa_strength"] in (32.0, 16.0)}
    leads = {k: v["attention_lead_share"] for k, v in fa.items()}
    zero = results["comparison"]["zero"]

    def earlier(run_id: str) -> Optional[bool]:
        ours = [zero.get(f"mechmon {f}") for f in ATTN]
        ours_steps = [o["first_alarm"].get(run_id) for o in ours if o]
        mine = _earliest(*ours_steps)
        if mine is None:
            return False
        for rival in ("max_attn_logit", "wq_spectral_norm"):
            entry = zero.get(rival)
            theirs = entry["first_alarm"].get(run_id) if entry else None
            if theirs is not None and theirs <= mine:
                return False
        return True

    router_only = {k: v for k, v in runs.items() if v["scenario"] == "moe-router-lr"}
    return {
        "healthy_alarms_at_default": healthy_alarms,
        "zero_healthy_alarms": all(n == 0 for n in healthy_alarms.values()),
        "fa_attention_lead_share": leads,
        "fa_lead_ge_75pct_every_seed": bool(leads) and all(s is not None and s >= 0.75 for s in leads.values()),
        "fa_earlier_than_logit_and_wq_at_zero_far": {k: earlier(k) for k in fa},
        "router_only_entropy_alarm_every_seed": bool(router_only)
        and all(v["first_alarm_default"]["router_entropy"] is not None for v in router_only.values()),
        "router_only_attention_alarm_before_divergence": {
            k: (
                v["attention_alarm"] is not None and (v["divergence"] is None or v["attention_alarm"] < v["divergence"])
            )
            for k, v in router_only.items()
        },
        "detector_us_per_check": results["detector_us_per_check"],
    }
