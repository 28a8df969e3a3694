"""The early-phase study's report: the frozen detector on the held-out runs, every target met or missed.

docs/METHOD.md section 8c pre-registers the study; this replays its held-out records (exported by
``tools/detector_study.py export --plan early-phase``) with a tail table unchanged (default: the
shipped one, whose phase moments apply where the record's schedule matches), at interval 20 and
(healthy runs) 100, and sets each fault run's first alarm beside the max-logit rule at two
thresholds, both fixed on the design records (``DESIGN_DIRS``) before the held-out runs were read:

- **equal footing**: the Gumbel law of the rule's per-run maxima on the design's healthy
  10,000-step records, extrapolated to the detector's false-alarm rate per run
  (``rule_footing.equal_footing``);
- **healthy-quiet** (unequal): the rule's most sensitive threshold with no alarm on those records
  (``shipped_replay.logit_rule_threshold``).

The targets (per cell of ulps x onset): against the equal rule, no later on every 16- and 32-ulp
run; against the quiet rule, no later than the rule plus one check on >= 90 % of runs and a median
delay no later than the rule's; 8 ulps: lead before divergence >= 30 % and an attention family;
zero alarms on every healthy run at intervals 20 and 100; learning-rate faults alarm on a router
family and never on a precision family; the alert's change point within one ``delta`` of the onset
on >= 90 % of the FA runs of each cell. Needs numpy (the rule scores).

    python -m mechmon_megatron.research.study.early_phase_report docs/data/early_phase [--calibration F]

Several folders may be given (their runs are named ``folder:run``), e.g. the design records.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

from mechmon_megatron.detect.families import FAMILIES
from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, TailTable, load_tail_table
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.detector_report import events, lead_share
from mechmon_megatron.research.study.early_phase_plan import LR_SCENARIOS
from mechmon_megatron.research.study.rule_footing import equal_footing
from mechmon_megatron.research.study.shipped_replay import (
    LOGIT_RULE,
    RECORDED_DELTA,
    RECORDED_INTERVAL,
    logit_rule_first,
    logit_rule_threshold,
    replay_shipped,
)

__all__ = ["DESIGN_DIRS", "FaultRun", "RuleThresholds", "early_phase_report", "markdown", "rule_thresholds"]

_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
DESIGN_DIRS = ("docs/data/detector_study", "docs/data/short_window_study", "docs/data/healthy_check_study")
"""The design records whose healthy 10,000-step runs set the rule's two thresholds."""
RUN_STEPS = 10_000
FA_RUN = re.compile(r"^fa-s(?P<ulps>\d+)-on(?P<onset>\d+)-seed\d+$")
PRECISION_FAMILIES = tuple(spec.name for spec in FAMILIES if spec.monitor == "attn")
"""The attention (precision-fault) families, from the family table."""


@dataclass(frozen=True)
class RuleThresholds:
    """The max-logit rule's thresholds (ratio to its reference median), fixed on the design records."""

    equal: float
    equal_interval: tuple[float, float]
    quiet: float
    healthy_runs: int


def rule_thresholds(root: str = _ROOT) -> RuleThresholds:
    """Both thresholds from the healthy 10,000-step records of :data:`DESIGN_DIRS`."""
    records: dict[str, CampaignRecord] = {}
    for rel in DESIGN_DIRS:
        for run_id, record in load_records(os.path.join(root, rel)).items():
            records[f"{rel}:{run_id}"] = record
    healthy = {k: r for k, r in records.items() if r.healthy and r.data.steps and r.data.steps[-1] == RUN_STEPS}
    cal = equal_footing(healthy, LOGIT_RULE, DEFAULT_FALSE_ALARM_RATE, RUN_STEPS)
    quiet = logit_rule_threshold(healthy)
    if quiet is None:
        raise ValueError("no healthy-quiet threshold of the max-logit rule on the design records")
    return RuleThresholds(equal=cal.threshold, equal_interval=tuple(cal.bootstrap_interval), quiet=quiet,
                          healthy_runs=len(healthy))


@dataclass(frozen=True)
class FaultRun:
    """One held-out fault run under the frozen detector (steps; None: no alarm / no event)."""

    run_id: str
    cell: str
    onset: int
    divergence: Optional[int]
    first_alarm: Optional[int]
    family: Optional[str]
    change_step: Optional[int]
    rule_equal: Optional[int]
    rule_quiet: Optional[int]
    alarms_before_onset: int
    lead: Optional[float]


def _fault_run(name: str, record: CampaignRecord, table: TailTable, rules: RuleThresholds) -> FaultRun:
    onset = record.run.fault_onset or 0
    alarms = replay_shipped(record, RECORDED_INTERVAL, table=table).alarms
    after = [a for a in alarms if a["step"] >= onset]
    first = after[0] if after else None
    m = FA_RUN.match(record.run.run_id)
    cell = f"s{m['ulps']}-on{m['onset']}" if m else record.run.run_id.rsplit("-seed", 1)[0]
    divergence = events(record)["divergence"]
    step = first["step"] if first else None
    return FaultRun(run_id=name, cell=cell, onset=onset, divergence=divergence, first_alarm=step,
                    family=first["family"] if first else None, change_step=first["change_step"] if first else None,
                    rule_equal=logit_rule_first(record, rules.equal), rule_quiet=logit_rule_first(record, rules.quiet),
                    alarms_before_onset=len(alarms) - len(after), lead=lead_share(step, divergence, onset))


def _no_later(alarm: Optional[int], rule: Optional[int], slack: int = 0) -> bool:
    """The detector alarmed and no later than the rule (plus ``slack`` steps); a rule that never
    fires loses to any alarm."""
    return alarm is not None and (rule is None or alarm <= rule + slack)


def _median(xs: Sequence[Optional[int]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def cell_summary(runs: Sequence[FaultRun]) -> dict[str, Any]:
    """One cell's counts and medians (delays after the onset, steps)."""
    n = len(runs)
    delay = _median([r.first_alarm - r.onset if r.first_alarm is not None else None for r in runs])
    rule_delay = _median([r.rule_quiet - r.onset if r.rule_quiet is not None else None for r in runs])
    return {
        "runs": n,
        "alarmed": sum(r.first_alarm is not None for r in runs),
        "median_delay": delay,
        "no_later_than_equal_rule": sum(_no_later(r.first_alarm, r.rule_equal) for r in runs),
        "no_later_than_quiet_rule": sum(_no_later(r.first_alarm, r.rule_quiet) for r in runs),
        "within_one_check_of_quiet_rule": sum(_no_later(r.first_alarm, r.rule_quiet, RECORDED_INTERVAL) for r in runs),
        "quiet_rule_median_delay": rule_delay,
        "change_within_delta": sum(r.change_step is not None and abs(r.change_step - r.onset) <= RECORDED_DELTA
                                   for r in runs),
        "attention_family": sum(r.family in PRECISION_FAMILIES for r in runs),
        "lead_ge_30pct": sum(r.lead is not None and r.lead >= 0.3 for r in runs),
        "alarms_before_onset": sum(r.alarms_before_onset for r in runs),
    }


def early_phase_report(records: Mapping[str, CampaignRecord], table: Optional[TailTable] = None,
                       rules: Optional[RuleThresholds] = None) -> dict[str, Any]:
    """Every held-out record replayed: fault runs by cell, healthy runs' alarms at intervals 20 and
    100, the learning-rate faults' first families."""
    table = table or load_tail_table()
    rules = rules or rule_thresholds()
    faults = [_fault_run(name, r, table, rules) for name, r in records.items() if FA_RUN.match(r.run.run_id)]
    cells: dict[str, list[FaultRun]] = {}
    for run in faults:
        cells.setdefault(run.cell, []).append(run)
    healthy = []
    for run_id, record in sorted(records.items()):
        if record.healthy:
            for interval in (RECORDED_INTERVAL, RECORDED_DELTA):
                alarms = replay_shipped(record, interval, table=table).alarms
                healthy.append({"run": run_id, "interval": interval, "steps": record.data.steps[-1],
                                "alarms": [(a["step"], a["family"], a["level"]) for a in alarms]})
    lr = []
    for run_id, record in sorted(records.items()):
        if record.run.scenario in LR_SCENARIOS:
            alarms = replay_shipped(record, RECORDED_INTERVAL, table=table).alarms
            families = [a["family"] for a in alarms]
            lr.append({"run": run_id, "first_family": families[0] if families else None,
                       "first_step": alarms[0]["step"] if alarms else None,
                       "precision_alarms": sum(f in PRECISION_FAMILIES for f in families)})
    return {
        "calibration": table.source,
        "rule": asdict(rules),
        "cells": {cell: cell_summary(runs) for cell, runs in sorted(cells.items())},
        "fault_runs": [asdict(r) for r in sorted(faults, key=lambda r: (r.cell, r.run_id))],
        "healthy": healthy,
        "lr_faults": lr,
    }


def _s(x: Any) -> str:
    return "-" if x is None else (f"{x:g}" if isinstance(x, float) else str(x))


def markdown(report: Mapping[str, Any]) -> str:
    """The tables of docs/RESULTS.md, "The early-phase study"."""
    rule = report["rule"]
    lines = [f"Max-logit rule: equal footing {rule['equal']:.2f} (bootstrap 90 %: {rule['equal_interval'][0]:.2f}-"
             f"{rule['equal_interval'][1]:.2f}), healthy-quiet {rule['quiet']:g} (both from {rule['healthy_runs']} "
             "healthy 10,000-step design records).", "",
             "| cell | runs | median delay | rule (quiet) median | no later than rule at equal footing | no later than "
             "quiet rule | within one check of it | change point within one delta | attention family |",
             "|---|---|---|---|---|---|---|---|---|"]
    for cell, c in report["cells"].items():
        n = c["runs"]
        lines.append(f"| {cell} | {n} | {_s(c['median_delay'])} | {_s(c['quiet_rule_median_delay'])} | "
                     f"{c['no_later_than_equal_rule']}/{n} | {c['no_later_than_quiet_rule']}/{n} | "
                     f"{c['within_one_check_of_quiet_rule']}/{n} | {c['change_within_delta']}/{n} | "
                     f"{c['attention_family']}/{n} |")
    lines += ["", "| run | onset | diverge | first alarm (family) | change point | rule equal | rule quiet | lead |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["fault_runs"]:
        lead = "-" if r["lead"] is None else f"{100 * r['lead']:.0f} %"
        lines.append(f"| {r['run_id']} | {r['onset']} | {_s(r['divergence'])} | {_s(r['first_alarm'])} "
                     f"({r['family'] or '-'}) | {_s(r['change_step'])} | {_s(r['rule_equal'])} | {_s(r['rule_quiet'])} "
                     f"| {lead} |")
    lines += ["", "| healthy run | steps | interval | alarms |", "|---|---|---|---|"]
    for h in report["healthy"]:
        lines.append(f"| {h['run']} | {h['steps']} | {h['interval']} | {len(h['alarms'])} "
                     f"{'' if not h['alarms'] else h['alarms']} |")
    lines += ["", "| learning-rate fault | first alarm | family | precision-family alarms |", "|---|---|---|---|"]
    for r in report["lr_faults"]:
        lines.append(f"| {r['run']} | {_s(r['first_step'])} | {r['first_family'] or '-'} | {r['precision_alarms']} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", help="folders of exported records (.json.gz)")
    p.add_argument("--calibration", default=None, help="a tail table (default: the shipped one)")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    args = p.parse_args(argv)
    records: dict[str, CampaignRecord] = {}
    for folder in args.records:
        prefix = f"{os.path.basename(os.path.normpath(folder))}:" if len(args.records) > 1 else ""
        records.update({prefix + run_id: r for run_id, r in load_records(folder).items()})
    report = early_phase_report(records, load_tail_table(args.calibration))
    print(markdown(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
