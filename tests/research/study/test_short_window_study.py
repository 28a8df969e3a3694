"""The short-window design study (issue 19) on synthetic streams, against brute force: the union
bound's test count and thresholds by hand, each family's first alarm from a detector fed that
family alone, the earliest of them, and the long design blind to the short streams."""

from __future__ import annotations

import math

import pytest

from mechmon_megatron.detect.pooled_cusum import PooledCusumDetector, default_sequential_config
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.pooled_replay import thresholds_at_rate
from mechmon_megatron.research.study.short_window_study import (
    CHOICE_RUNS,
    SHORT,
    calibrate_short,
    choice_verdict,
    markdown,
    only_families,
    run_short_window_study,
)
from mechmon_megatron.session.detector_inputs import observations_from_scalars
from tests.research.study.synthetic import campaign_record, detector_checks

INTERVAL, LAYERS, HEADS, RATE = 20, 2, 2, 0.01


def _record(run_id: str, kind: str, seed: int, steps: int, onset=None, short_drop_at=None,
            long_drop_at=None) -> CampaignRecord:
    assert (kind == "healthy") == (onset is None)
    return campaign_record(run_id, seed, steps, detector_checks(steps, seed, INTERVAL, long_drop_at=long_drop_at,
                                                                short_drop_at=short_drop_at), onset)


@pytest.fixture(scope="module")
def records() -> dict[str, CampaignRecord]:
    return {
        "healthy-cosine-seed1": _record("healthy-cosine-seed1", "healthy", 1, 4000),
        "healthy-cosine-seed2": _record("healthy-cosine-seed2", "healthy", 2, 4000),
        "fa-s32-on1000-seed1": _record("fa-s32-on1000-seed1", "fault", 11, 1600, onset=1000,
                                       short_drop_at=1000, long_drop_at=1200),
    }


@pytest.fixture(scope="module")
def results(records):
    return run_short_window_study(records, rate=RATE)


def test_union_bound_counts_the_short_tests_and_splits_p(results, records):
    table, _ = calibrate_short(records)
    checks_per_million = 1e6 / INTERVAL
    for design, families in (("long", 4), ("long+short", 5)):
        tests = families * (LAYERS + 1)  # one CUSUM per layer plus the family CUSUM
        d = results["designs"][design]
        assert d["tests"] == tests
        p = RATE / (tests * checks_per_million)
        assert d["per_test_check_probability"] == pytest.approx(p, rel=1e-12)
        for family, levels in d["thresholds"].items():
            for level in ("layer", "family"):
                tail, _ = table.tail(5, family, level)
                by_hand = tail.u0 + max(0.0, (tail.log_p_u0 - math.log(p)) / tail.theta)
                assert levels[level]["alarm"] == pytest.approx(max(by_hand, levels[level]["warning"]), rel=1e-12)
    assert SHORT in results["designs"]["long+short"]["thresholds"]
    assert SHORT not in results["designs"]["long"]["thresholds"]


def test_first_alarms_equal_one_detector_per_family(results, records):
    table, _ = calibrate_short(records)
    record = records["fa-s32-on1000-seed1"]
    families = ("attn_delta2", "attn_dw", "router_entropy", "router_weights", SHORT)
    thresholds, _ = thresholds_at_rate(records["healthy-cosine-seed1"].data.checks, INTERVAL, 5, RATE, table)
    by_family = {}
    for family in families:  # brute force: a fresh detector that sees only this family
        det = PooledCusumDetector({family: thresholds[family]}, default_sequential_config(INTERVAL))
        first = None
        for step, scalars in record.data.checks:
            obs = [o for o in observations_from_scalars(scalars) if o.family == family]
            if det.update(step, obs).alarms and first is None and step >= 1000:
                first = step
        by_family[family] = first
    got = results["runs"]["fa-s32-on1000-seed1"]["long+short"]
    assert got["by_family"] == by_family
    fired = [s for s in by_family.values() if s is not None]
    assert got["first_alarm"] == min(fired)
    assert by_family[SHORT] is not None and by_family[SHORT] < 1200  # the short window's own drop
    long = results["runs"]["fa-s32-on1000-seed1"]["long"]
    assert SHORT not in long["by_family"] and long["first_alarm"] >= 1200  # blind to the short streams
    for run_id in ("healthy-cosine-seed1", "healthy-cosine-seed2"):
        assert results["runs"][run_id]["long"]["alarms"] == []
        assert results["runs"][run_id]["long+short"]["alarms"] == []
    assert got["first_layers"] == long["first_layers"] == [1]  # the drop is in layer 1 only
    assert "| fa-s32-on1000-seed1 |" in markdown(results) and "(L1)" in markdown(results)


def test_product_tails_are_fitted_without_the_short_streams(records):
    from mechmon_megatron.research.study.pooled_replay import CORE_FAMILIES, calibrate_on_runs

    table, _ = calibrate_short(records)
    series = [only_families(records[r].data.checks, CORE_FAMILIES)
              for r in ("healthy-cosine-seed1", "healthy-cosine-seed2")]
    plain, _ = calibrate_on_runs(series, INTERVAL, 100)
    for family in CORE_FAMILIES:
        assert table.tails[5][family] == plain.tails[5][family]
    assert SHORT in table.tails[5]


def test_only_families_drops_exactly_the_other_detector_streams(records):
    checks = records["fa-s32-on1000-seed1"].data.checks
    kept = only_families(checks, ("attn_delta2",))
    names = set(kept[0][1])
    assert all("delta2_entropy_short" not in n and "dw_entropy" not in n for n in names)
    assert sum("delta2_entropy/layer_" in n for n in names) == LAYERS * HEADS
    assert len(kept) == len(checks)


def test_calibration_without_the_short_streams_is_refused():
    plain = {r: campaign_record(r, i, 400, detector_checks(400, i, INTERVAL, short=False))
             for i, r in enumerate(("healthy-cosine-seed1", "healthy-cosine-seed2"))}
    with pytest.raises(ValueError, match="no attn_delta2_short streams"):
        calibrate_short(plain)
    with pytest.raises(ValueError, match="not in the records"):
        calibrate_short({})
    for record in plain.values():
        record.status = {"state": "running"}
    with pytest.raises(ValueError, match="not finished.*healthy-cosine-seed1 running 400"):
        calibrate_short(plain)


def _entry(onset, long_first, short_first, family="attn_delta2", state="stopped-after-divergence", alarms=0):
    return {"onset": onset, "state": state, "healthy": False,
            "long": {"first_alarm": long_first, "first_family": "attn_delta2", "alarms": []},
            "long+short": {"first_alarm": short_first, "first_family": family, "alarms": [[0, "x", 0, "c"]] * alarms}}


def _choice_results(pairs, calibration_alarms=0, family="attn_delta2"):
    runs = {r: _entry(500, 500 + a, None if b is None else 500 + b, family=family)
            for r, (a, b) in zip(CHOICE_RUNS, pairs)}
    for r in ("healthy-cosine-seed1", "healthy-cosine-seed2"):
        runs[r] = _entry(None, None, None, state="done", alarms=calibration_alarms)
    return {"runs": runs, "calibration_runs": ["healthy-cosine-seed1", "healthy-cosine-seed2"]}


def test_choice_verdict_applies_the_preregistered_rule():
    """Each clause of the rule flips the verdict on its own; a missing run makes it incomplete."""
    earlier_half = [(100, 80)] * 6 + [(100, 100)] * 6
    assert choice_verdict(_choice_results(earlier_half))["verdict"] == "long+short"
    one_later = [(100, 80)] * 6 + [(100, 100)] * 5 + [(100, 120)]
    verdict = choice_verdict(_choice_results(one_later))
    assert verdict["verdict"] == "long" and verdict["later"] == [CHOICE_RUNS[-1]]
    assert "+120 vs +100" in verdict["reasons"][0]
    assert choice_verdict(_choice_results([(100, 80)] * 5 + [(100, 100)] * 7))["verdict"] == "long"
    assert choice_verdict(_choice_results(earlier_half, calibration_alarms=1))["verdict"] == "long"
    assert choice_verdict(_choice_results(earlier_half, family="router_entropy"))["verdict"] == "long"
    no_alarm = [(100, 80)] * 11 + [(100, None)]  # no alarm counts as later than any alarm
    assert choice_verdict(_choice_results(no_alarm))["later"] == [CHOICE_RUNS[-1]]
    partial = _choice_results(earlier_half)
    del partial["runs"][CHOICE_RUNS[0]]
    assert choice_verdict(partial)["verdict"] == "incomplete"
