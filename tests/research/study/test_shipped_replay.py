"""The shipped detector on the held-out runs of seeds 10-12 (10,000-step healthy runs and their FA
forks; docs/RESULTS.md, "Healthy runs"): pure replays of the committed records, no training."""

import os

import pytest

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, thresholds_for_job
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.detector_report import CALIBRATION_RUNS
from mechmon_megatron.research.study.pooled_replay import CORE_FAMILIES, fit_tail_table, proxy_shape, replay_pooled
from mechmon_megatron.research.study.shipped_replay import (
    fault_markdown,
    fault_row,
    markdown,
    only_families,
    replay_shipped,
)
from tests.research.study.synthetic import detector_checks

RECORDS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "data", "short_window_study")
HELD_OUT = ("healthy-cosine-seed10", "healthy-cosine-seed11", "healthy-cosine-seed12")


@pytest.fixture(scope="module")
def records():
    if not os.path.isdir(RECORDS):
        pytest.skip("docs/data/short_window_study not present")
    return load_records(RECORDS)


def test_only_families_drops_exactly_the_other_detector_streams():
    checks = [(row["step"], row["scalars"]) for row in detector_checks(200, seed=1)]
    kept = only_families(checks, ("attn_delta2",))
    names = set(kept[0][1])
    assert all("delta2_entropy_short" not in n and "dw_entropy" not in n for n in names)
    assert sum("delta2_entropy/layer_" in n for n in names) == 2 * 2  # layers x heads
    assert len(kept) == len(checks)


@pytest.mark.parametrize("interval", [20, 100])
def test_the_shipped_detector_is_quiet_on_the_held_out_healthy_runs(records, interval):
    for run_id in HELD_OUT:
        replay = replay_shipped(records[run_id], interval)
        assert replay.steps == 10_000
        assert not replay.alarms, (run_id, interval, replay.alarms[:2])
        for margins in replay.margins.values():
            assert all(m.largest <= m.alarm for m in margins)


def test_seed11_is_a_near_miss_that_a_refit_on_other_realisations_turns_into_an_alarm(records):
    shipped = replay_shipped(records["healthy-cosine-seed11"], 20)
    layer = next(m for m in shipped.margins["router_entropy"] if m.level == "layer")
    assert layer.layer == 4 and layer.warning - 1.0 < layer.largest < layer.warning  # under it by < 1 unit
    # The same families with tails refitted on this campaign's own seed 1-2 runs instead of the shipped ones.
    series = [only_families(records[r].data.checks, CORE_FAMILIES) for r in CALIBRATION_RUNS]
    table, _ = fit_tail_table({5: (20, series)})
    thresholds, account = thresholds_for_job(proxy_shape(series[0], 20, 5), DEFAULT_FALSE_ALARM_RATE, table)
    assert thresholds["router_entropy"].layer.warning < layer.largest
    checks = only_families(records["healthy-cosine-seed11"].data.checks, CORE_FAMILIES)
    replay = replay_pooled(checks, thresholds, default_sequential_config(20),
                           warning_probability=account.warning_per_test_check_probability)
    assert [(a.step, a.family, a.level, a.layers) for a in replay.alarms] == [(680, "router_entropy", "layer", (4,))]
    # the session's misfit counter names the family 140 steps before that false alarm
    assert replay.misfits == [(540, "router_entropy")]
    assert not shipped.misfits


def test_markdown_names_each_alarm_and_the_bad_interval_is_refused(records):
    rows = markdown([replay_shipped(records["healthy-cosine-seed11"], 20)]).splitlines()
    assert len(rows) == 3 and "| healthy-cosine-seed11 | 20 | 0 | router_entropy layer 4 at 600:" in rows[2]
    with pytest.raises(ValueError, match="multiple of 20"):
        replay_shipped(records["healthy-cosine-seed11"], 30)


def test_the_shipped_detector_names_attention_first_on_the_held_out_fa_runs(records):
    fa = [r for r in records.values() if r.run.scenario == "fa" and r.run.seed in (10, 11, 12)]
    assert len(fa) == 12
    for record in fa:
        alarms = replay_shipped(record, 20).alarms
        assert alarms and alarms[0]["step"] > record.run.fault_onset, record.run.run_id
        assert alarms[0]["family"] in ("attn_delta2", "attn_dw"), (record.run.run_id, alarms[0])


def test_fault_rows_put_the_first_alarm_beside_the_rule(records):
    row = fault_row(records["fa-s32-on2000-seed11"], 2.5)
    got = (row.onset, row.first_alarm, row.first_family, row.delta2, row.rule)
    assert got == (2000, 2060, "attn_delta2", 2060, 2120)
    assert row.alarms_before_onset == 0 and row.divergence is not None and 0.75 < row.lead < 1
    table = fault_markdown([row], 2.5).splitlines()
    assert table[0].startswith("| run | onset |") and table[2].endswith("| yes |")
