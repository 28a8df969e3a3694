"""Round 8 of issue 19 (the persistence of Delta2's leading direction as a family): the sign change
it rests on, checked against a rising family through the whole pooled detector, and the study on
synthetic records (the persistence family alarms on its own rise; ``long`` is blind to it)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from mechmon_megatron.detect.pooled_cusum import (
    FamilyThresholds,
    Observation,
    PooledCusumDetector,
    Thresholds,
    default_sequential_config,
)
from mechmon_megatron.detect.robust_trend import RobustTrend, TrendConfig
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.persistence_study import (
    markdown,
    persistence_as_short_family,
    persistence_records,
    run_persistence_study,
)
from mechmon_megatron.research.study.short_window_study import SHORT
from tests.research.study.synthetic import campaign_record, detector_checks

INTERVAL, LAYERS, HEADS = 20, 2, 2


def test_a_rise_of_x_is_a_drop_of_minus_x_in_the_baseline():
    rng = random.Random(3)
    config = TrendConfig(window=30, warmup=10, min_trend=10)
    rise, drop = RobustTrend(config, "rise"), RobustTrend(config, "drop")
    compared = 0
    for i in range(200):
        x = 0.2 + 0.001 * i * (1 if i < 100 else -1) + rng.gauss(0, 0.05)
        p, q = rise.predict(), drop.predict()
        if p is not None:
            assert q is not None and rise.residual(x, p) == drop.residual(-x, q)
            assert (p.center, p.scale, p.slope) == (-q.center, q.scale, -q.slope)
            compared += 1
        rise.accept(x)
        drop.accept(-x)
    assert compared == 190


def test_negated_streams_as_a_drop_family_equal_the_same_streams_as_a_rise_family():
    """Brute force through the whole detector: ``router_weights`` (rise) fed x and the short family
    (drop) fed -x, with the same baseline design and thresholds, give the same CUSUMs and alarms."""
    base = default_sequential_config(INTERVAL)
    config = replace(base, family_trends={})  # the same baseline for both families
    levels = FamilyThresholds(layer=Thresholds(warning=3.0, alarm=6.0), family=Thresholds(warning=3.0, alarm=6.0))
    rising = PooledCusumDetector({"router_weights": levels}, config)
    negated = PooledCusumDetector({SHORT: levels}, config)
    rng = random.Random(5)
    alarms = compared = 0
    for k in range(1, 120):
        values = {(layer, head): 0.2 + (0.02 * (k - 80) if k > 80 and layer == 1 else 0.0) + rng.gauss(0, 0.04)
                  for layer in (1, 2) for head in range(3)}
        a = rising.update(k * INTERVAL, [Observation("router_weights", layer, f"head_{h}", v)
                                         for (layer, h), v in values.items()])
        b = negated.update(k * INTERVAL, [Observation(SHORT, layer, f"head_{h}", -v)
                                          for (layer, h), v in values.items()])
        stats_a = {key.split("/", 1)[1]: v for key, v in a.statistics.items() if "/cusum" in key}
        stats_b = {key.split("/", 1)[1]: v for key, v in b.statistics.items() if "/cusum" in key}
        assert stats_a == stats_b
        compared += bool(stats_a)
        assert [(x.step, x.level, x.layers, x.members) for x in a.alarms] == \
            [(x.step, x.level, x.layers, x.members) for x in b.alarms]
        alarms += len(a.alarms)
    assert compared > 100 and alarms > 0  # past the warm-up; the rise in layer 1 is caught, by both


def _record(run_id: str, seed: int, steps: int, onset=None) -> CampaignRecord:
    checks = detector_checks(steps, seed, INTERVAL, persistence=True, persistence_rise_at=onset)
    return campaign_record(run_id, seed, steps, checks, onset)


@pytest.fixture(scope="module")
def records() -> dict[str, CampaignRecord]:
    return {
        "healthy-cosine-seed1": _record("healthy-cosine-seed1", 1, 4000),
        "healthy-cosine-seed2": _record("healthy-cosine-seed2", 2, 4000),
        "fa-s32-on1000-seed1": _record("fa-s32-on1000-seed1", 11, 1600, onset=1000),
    }


def test_the_short_entropy_streams_are_replaced_by_the_negated_persistence(records):
    checks = records["fa-s32-on1000-seed1"].data.checks
    moved = persistence_as_short_family(checks)
    step, first = moved[0]
    assert step == INTERVAL and not any("delta2_entropy_short" in k for k in first)  # no persistence yet
    _, original = checks[10]
    _, second = moved[10]
    for layer in range(1, LAYERS + 1):
        for head in range(HEADS):
            assert second[f"mechmon/attn/delta2_entropy_short/layer_{layer}/head_{head}"] == -original[
                f"mechmon/attn/delta2_short_persistence/layer_{layer}/head_{head}"]
    assert {k for k in second if "delta2_entropy_short" not in k} == {
        k for k in original if "delta2_entropy_short" not in k}


def test_the_persistence_family_alarms_on_its_rise_and_long_is_blind(records):
    results = run_persistence_study(records, rate=0.01)
    fault = results["runs"]["fa-s32-on1000-seed1"]
    assert fault["long"]["first_alarm"] is None  # nothing else moves
    first = fault["long+short"]["by_family"][SHORT]
    assert first is not None and 1000 <= first <= 1100 and fault["long+short"]["first_layers"] == [1]
    for run_id in ("healthy-cosine-seed1", "healthy-cosine-seed2"):
        assert results["runs"][run_id]["long+short"]["alarms"] == []
    text = markdown(results)
    assert "long+persist" in text and "attn_persistence (L1)" in text and "long+short" not in text


def test_records_without_persistence_are_refused_naming_the_run(records):
    plain = records["healthy-cosine-seed1"]
    stripped = replace(plain, data=replace(plain.data, checks=[
        (s, {k: v for k, v in sc.items() if "persistence" not in k}) for s, sc in plain.data.checks]))
    with pytest.raises(ValueError, match="healthy-cosine-seed1.*--mechmon-short-window"):
        persistence_records({"healthy-cosine-seed1": stripped, "fa-s32-on1000-seed1": records["fa-s32-on1000-seed1"]})
