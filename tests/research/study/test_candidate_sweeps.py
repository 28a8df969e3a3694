"""Delay against false-alarm rate with issue 19's candidate families (``candidate_sweeps``) on
synthetic records: a family swept alone equals the same family in the full sweep, the median
delay at zero healthy alarms against brute force, and the plot files."""

from __future__ import annotations

import statistics

import pytest

from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.candidate_sweeps import (
    CURVES,
    PERSISTENCE,
    candidate_sweeps,
    markdown,
    median_delay_at_zero,
)
from mechmon_megatron.research.study.detector_report import mechmon_sweep
from mechmon_megatron.research.study.pooled_replay import CORE_FAMILIES
from mechmon_megatron.research.study.short_window_study import SHORT, calibrate_short
from tests.research.study.synthetic import campaign_record, detector_checks

INTERVAL = 20


def _record(run_id: str, seed: int, steps: int, onset=None) -> CampaignRecord:
    checks = detector_checks(steps, seed, INTERVAL, long_drop_at=onset, persistence=True, persistence_rise_at=onset)
    return campaign_record(run_id, seed, steps, checks, onset)


@pytest.fixture(scope="module")
def records() -> dict[str, CampaignRecord]:
    return {
        "healthy-cosine-seed1": _record("healthy-cosine-seed1", 1, 3000),
        "healthy-cosine-seed2": _record("healthy-cosine-seed2", 2, 3000),
        "fa-s32-on1000-seed1": _record("fa-s32-on1000-seed1", 11, 1400, onset=1000),
        "fa-s32-on1000-layers2-seed2": _record("fa-s32-on1000-layers2-seed2", 12, 1400, onset=1000),
    }


@pytest.fixture(scope="module")
def results(records):
    return candidate_sweeps(records)


def test_a_family_swept_alone_is_the_same_family_in_the_full_sweep(records):
    table, _ = calibrate_short(records)
    alone, _ = mechmon_sweep(records, table, families=(SHORT,))
    full, _ = mechmon_sweep(records, table, families=(*CORE_FAMILIES, SHORT))
    assert alone[SHORT] == full[SHORT] and set(full) == {*CORE_FAMILIES, SHORT}


def test_curves_groups_and_the_median_delay_at_zero_against_brute_force(results):
    assert set(results["sweeps"]) <= set(CURVES) and PERSISTENCE in results["sweeps"]
    runs = results["runs"]
    assert runs["fa-s32-on1000-layers2-seed2"]["group"] == "fa 32 ulps, onset 1000, layer 2 only"
    assert runs["fa-s32-on1000-seed1"]["group"] == "fa 32 ulps, onset 1000"
    table = median_delay_at_zero(results)
    sweep = results["sweeps"][PERSISTENCE]
    quiet = [i for i, e in enumerate(sweep["healthy_episodes"]) if e == 0]
    firsts = sweep["first_alarm"][max(quiet)]
    for group in ("fa 32 ulps, onset 1000", "fa 32 ulps, onset 1000, layer 2 only"):
        members = [r for r, v in runs.items() if v["group"] == group]
        cap = max(runs[m]["steps"] - runs[m]["onset"] for m in members)
        want = statistics.median(cap if firsts[m] is None else firsts[m] - runs[m]["onset"] for m in members)
        assert table[PERSISTENCE][group] == want
    assert table[PERSISTENCE]["fa 32 ulps, onset 1000"] <= 100  # its own rise is caught within five checks
    assert "| mechmon attn_persistence |" in markdown(results)


def test_the_plots_are_written(results, tmp_path):
    from mechmon_megatron.research.study.detector_plots import plot_delay_vs_far

    paths = plot_delay_vs_far(results, str(tmp_path), rules=CURVES, prefix="candidates")
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
        "candidates_fa_32_ulps__onset_1000.png", "candidates_fa_32_ulps__onset_1000__layer_2_only.png"]
    assert all((tmp_path / p.rsplit("/", 1)[1]).stat().st_size > 10_000 for p in paths)
