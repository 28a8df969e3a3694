"""The pooled CUSUM detector on hand-built checks: recursion, pooling, limit, state."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mechmon_megatron.detect.pooled_cusum import (
    FamilyThresholds,
    Observation,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
    default_sequential_config,
    trimmed_mean,
    warmup_checks,
)
from mechmon_megatron.detect.robust_trend import TrendConfig

FAR = Thresholds(warning=1e9, alarm=1e9)
CFG = SequentialConfig(trend=TrendConfig(warmup=5, min_trend=50, window=50, rel_scale_floor=0.0, abs_scale_floor=0.01))


def thresholds(layer=(1e9, 1e9), family=(1e9, 1e9), families=("attn_delta2",)):
    return {f: FamilyThresholds(layer=Thresholds(*layer), family=Thresholds(*family)) for f in families}


def heads(layer, values, family="attn_delta2"):
    return [Observation(family=family, layer=layer, member=f"head_{h}", value=v) for h, v in enumerate(values)]


def warm(det, layers=(1,), n_heads=4, steps=5, family="attn_delta2"):
    """Constant warm-up: the scale is the absolute floor 0.01, so a value 0.01 * z below 1.0 has residual z."""
    step = 0
    for step in range(1, steps + 1):
        det.update(step * 10, [o for L in layers for o in heads(L, [1.0] * n_heads, family)])
    return step * 10


@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=40), st.sampled_from([0.0, 0.1, 0.25, 0.4]))
def test_trimmed_mean_matches_brute_force(xs, trim):
    xs_sorted = sorted(xs)
    cut = int(math.floor(trim * len(xs)))
    kept = xs_sorted[cut : len(xs) - cut] or xs_sorted
    assert trimmed_mean(xs, trim) == pytest.approx(sum(kept) / len(kept), rel=1e-9, abs=1e-9)


def test_cusum_recursion_and_alarm_with_change_point():
    det = PooledCusumDetector(thresholds(layer=(3.0, 5.0)), CFG)
    step = warm(det)
    zs = [3.0, 3.0, 3.0]  # increments u - k = 2 each
    expected = [2.0, 4.0, 6.0]
    for z, s in zip(zs, expected):
        step += 10
        res = det.update(step, heads(1, [1.0 - 0.01 * z] * 4))
        assert res.statistics["attn_delta2/cusum/layer_1"] == pytest.approx(s)
        if s > 5.0:
            (alarm,) = res.alarms
            assert alarm.level == "layer" and alarm.layers == (1,) and alarm.kind == "cusum"
            assert alarm.change_step == step - 30  # the last check at which S was 0
            assert set(alarm.members) == {"head_0", "head_1", "head_2", "head_3"}
            assert det.first_alarm_steps == {"attn_delta2": step}
        else:
            assert not res.alarms
            assert res.warnings == ([("attn_delta2", 1)] if s > 3.0 else [])


def test_one_noisy_head_is_not_an_alarm_but_a_coherent_shift_is():
    det = PooledCusumDetector(thresholds(layer=(4.0, 8.0)), CFG)
    step = warm(det)
    for _ in range(10):  # head 0 far out, the others in band: the trimmed mean ignores it
        step += 10
        assert not det.update(step, heads(1, [1.0 - 0.5, 1.0, 1.0, 1.0])).alarms
    det2 = PooledCusumDetector(thresholds(layer=(4.0, 8.0)), CFG)
    step = warm(det2)
    fired = []
    for _ in range(5):
        step += 10
        fired += det2.update(step, heads(1, [1.0 - 0.04, 1.0 - 0.05, 1.0 - 0.03, 1.0 - 0.06])).alarms
    assert fired and fired[0].members[0] == "head_3"


def test_family_test_pools_layers():
    det = PooledCusumDetector(thresholds(layer=(50.0, 100.0), family=(2.0, 4.0)), CFG)
    step = warm(det, layers=(1, 2, 3, 4))
    fired = []
    for _ in range(4):
        step += 10
        obs = [o for L in (1, 2, 3, 4) for o in heads(L, [1.0 - 0.01 * (2.5 + 0.1 * L)] * 4)]
        fired += det.update(step, obs).alarms
    assert fired and fired[0].level == "family"
    assert fired[0].layers[0] == 4  # the layer that carries most of it comes first


def test_suspect_values_stay_out_of_the_baseline_and_alarm_restarts():
    det = PooledCusumDetector(thresholds(layer=(1.0, 20.0)), CFG)
    step = warm(det)
    step += 10
    det.update(step, heads(1, [0.97] * 4))  # S = 2 > warning 1: not absorbed
    assert list(det._trends[("attn_delta2", 1, "head_0")].values) == [1.0] * 5
    for _ in range(20):
        step += 10
        res = det.update(step, heads(1, [0.97] * 4))
        if res.alarms:
            break
    assert res.alarms
    assert len(det._trends[("attn_delta2", 1, "head_0")].values) == 0  # restarted: re-learns the level


def test_absolute_limit_stands_in_before_the_baseline():
    fam = ("router_entropy",)
    det = PooledCusumDetector(thresholds(families=fam), CFG)

    def obs(v):
        return [
            Observation(
                family="router_entropy",
                layer=2,
                member="token_entropy",
                value=v,
                limit=0.69,
                limit_reason="below log(top-k)",
            )
        ]

    assert not det.update(10, obs(1.5)).alarms  # above the limit: accepted, but no baseline yet
    assert not det.update(20, obs(0.5)).alarms
    assert not det.update(30, obs(0.5)).alarms
    (alarm,) = det.update(40, obs(0.5)).alarms
    assert alarm.kind == "limit" and alarm.layers == (2,) and alarm.reason == "below log(top-k)"
    # No baseline has existed since the stream's first check: the change point is that check, not
    # the first value beyond the limit (the drift towards it may have begun before the values crossed it).
    assert alarm.change_step == 10
    assert list(det._trends[("router_entropy", 2, "token_entropy")].values) == [1.5]  # beyond it: never absorbed
    det2 = PooledCusumDetector(thresholds(families=fam), CFG)
    for i in range(1, 7):
        det2.update(10 * i, obs(1.5))
    for i in range(7, 12):  # with a baseline the limit no longer decides
        assert not [a for a in det2.update(10 * i, obs(1.5)).alarms if a.kind == "limit"]


def test_limit_change_point_is_the_first_check_across_a_resume():
    import json

    fam = ("router_entropy",)

    def obs(v):
        return [Observation(family="router_entropy", layer=1, member="token_entropy", value=v, limit=0.69)]

    det = PooledCusumDetector(thresholds(families=fam), CFG)
    det.update(100, obs(1.5))
    det.update(120, obs(0.5))
    resumed = PooledCusumDetector(thresholds(families=fam), CFG)
    resumed.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert not resumed.update(140, obs(0.5)).alarms
    (alarm,) = resumed.update(160, obs(0.5)).alarms
    assert alarm.kind == "limit" and alarm.change_step == 100
    older = det.state_dict()
    del older["unbased_since"]  # a state saved by an older release: the change point is unknown
    legacy = PooledCusumDetector(thresholds(families=fam), CFG)
    legacy.load_state_dict(older)
    legacy.update(140, obs(0.5))
    (alarm,) = legacy.update(160, obs(0.5)).alarms
    assert alarm.change_step is None


def test_limit_change_point_after_a_restart_is_the_first_check_of_the_new_period():
    fam = ("router_entropy",)

    def obs(v):
        return [Observation(family="router_entropy", layer=1, member="token_entropy", value=v, limit=0.69)]

    det = PooledCusumDetector(thresholds(families=fam), CFG)
    for i in range(1, 8):  # a baseline forms: the limit no longer judges
        det.update(10 * i, obs(1.5))
    (restart,) = det.update(80, obs(float("nan"))).alarms  # the layer restarts: no baseline again
    assert restart.kind == "nonfinite"
    assert not det.update(90, obs(0.5)).alarms and not det.update(100, obs(0.5)).alarms
    (alarm,) = det.update(110, obs(0.5)).alarms
    assert alarm.kind == "limit" and alarm.change_step == 90


def test_non_finite_value_alarms_at_once():
    det = PooledCusumDetector(thresholds(), CFG)
    (alarm,) = det.update(10, heads(3, [1.0, float("nan"), 1.0, 1.0])).alarms
    assert alarm.kind == "nonfinite" and alarm.layers == (3,) and alarm.members == ("head_1",)


def test_state_round_trip_continues_identically():
    import json
    import random

    rng = random.Random(0)
    checks = [
        (10 * i, heads(1, [1.0 + rng.gauss(0, 0.01) - (0.05 if i > 30 else 0.0) for _ in range(4)]))
        for i in range(1, 45)
    ]
    a = PooledCusumDetector(thresholds(layer=(3.0, 6.0)), CFG)
    ra = [a.update(s, o) for s, o in checks]
    b = PooledCusumDetector(thresholds(layer=(3.0, 6.0)), CFG)
    for s, o in checks[:20]:
        b.update(s, o)
    c = PooledCusumDetector(thresholds(layer=(3.0, 6.0)), CFG)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    rc = [c.update(s, o) for s, o in checks[20:]]
    assert [r.statistics for r in ra[20:]] == [r.statistics for r in rc]
    assert [r.alarms for r in ra[20:]] == [r.alarms for r in rc]
    assert any(r.alarms for r in rc)


def test_bad_inputs_are_named():
    det = PooledCusumDetector(thresholds(), CFG)
    with pytest.raises(ValueError, match="unknown detector family"):
        det.update(1, [Observation(family="attn_qk", layer=1, member="", value=1.0)])
    with pytest.raises(ValueError, match="no thresholds"):
        det.update(1, [Observation(family="router_weights", layer=1, member="", value=1.0)])
    with pytest.raises(ValueError, match="version"):
        det.load_state_dict({"version": 99})
    with pytest.raises(ValueError):
        Thresholds(warning=5.0, alarm=1.0)
    with pytest.raises(ValueError):
        SequentialConfig(reference=2.0, clip=1.0)


def test_warmup_is_measured_in_steps():
    assert warmup_checks(20) == 10 and warmup_checks(100) == 5 and warmup_checks(10) == 20
    assert default_sequential_config(100).trend.warmup == 5
    assert default_sequential_config(20).trend_of("router_weights").abs_scale_floor == 0.005
