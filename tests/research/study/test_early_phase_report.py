"""The early-phase study's report and the demo's equal-footing table, on the committed design
records (docs/data/detector_study): the rule's thresholds come from the design's healthy runs by
the frozen procedure, and each count is what the per-run rows say."""

from __future__ import annotations

import os

import pytest

from mechmon_megatron.research.study.analysis import RunData
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.demo_footing import footing_lines
from mechmon_megatron.research.study.early_phase_report import (
    RuleThresholds,
    cell_summary,
    early_phase_report,
    markdown,
    rule_thresholds,
)
from mechmon_megatron.research.study.shipped_replay import logit_rule_after, logit_rule_first

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
RECORDS = os.path.join(ROOT, "docs", "data", "detector_study")

pytestmark = pytest.mark.skipif(not os.path.isdir(RECORDS), reason="docs/data/detector_study not present")


@pytest.fixture(scope="module")
def records():
    return load_records(RECORDS)


@pytest.fixture(scope="module")
def rules() -> RuleThresholds:
    return rule_thresholds(ROOT)


def test_the_rule_thresholds_are_the_frozen_procedures(rules):
    # 13 healthy 10,000-step design records; the equal threshold extrapolates beyond every maximum.
    assert rules.healthy_runs == 13
    assert rules.quiet == 2.5
    assert rules.equal_interval[0] < rules.equal < rules.equal_interval[1]
    assert round(rules.equal, 2) == 4.09


def test_each_cell_counts_what_its_rows_say(records, rules):
    fa = {k: r for k, r in records.items() if k.startswith("fa-s32-on500")}
    report = early_phase_report(fa, rules=rules)
    rows = report["fault_runs"]
    assert [r["run_id"] for r in rows] == sorted(fa) and set(report["cells"]) == {"s32-on500"}
    cell = report["cells"]["s32-on500"]
    assert cell["runs"] == 3
    assert cell["no_later_than_equal_rule"] == sum(
        r["first_alarm"] is not None and (r["rule_equal"] is None or r["first_alarm"] <= r["rule_equal"]) for r in rows)
    assert cell["change_within_delta"] == sum(abs(r["change_step"] - r["onset"]) <= 100 for r in rows)
    for row in rows:
        assert row["rule_quiet"] == logit_rule_first(records[row["run_id"]], rules.quiet)
        assert row["first_alarm"] >= row["onset"] and row["family"] in ("attn_delta2", "attn_dw")
    assert "| s32-on500 | 3 |" in markdown(report)


def test_an_empty_cell_and_a_rule_that_never_fires():
    assert cell_summary([])["runs"] == 0


def test_the_demo_table_reads_the_rule_as_the_report_does(records, rules):
    record = records["fa-s32-on500-seed1"]
    d = record.data
    data = RunData(steps=list(d.steps), loss=list(d.loss), grad_norm=list(d.grad_norm),
                   max_attn_logit=list(d.max_attn_logit), checks=list(d.checks))
    for threshold in (rules.equal, rules.quiet):
        assert logit_rule_after(data, threshold, 500) == logit_rule_first(record, threshold)
    run = {"run_id": "fa", "scenario": "fa", "seed": 1, "fault_onset": 500,
           "first_alarm": {"attn_delta2": 580, "attn_dw": None, "router_entropy": None, "router_weights": None}}
    lines = footing_lines([run], {"fa": data}, rules)
    verdict = lines[-1]
    equal = logit_rule_after(data, rules.equal, 500)
    first = "mechmon first" if equal is None or 580 <= equal else "the rule first"
    assert verdict.startswith(f"fa seed 1: {first}")
