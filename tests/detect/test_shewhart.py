"""The Shewhart option against brute force: alarm step, union-bound split, threshold formula,
and the default (off) leaving today's detector unchanged."""

import math
import random

import pytest

from mechmon_megatron.detect.null_model import (
    SHEWHART_SHARE,
    JobShape,
    NullTail,
    TailTable,
    thresholds_for_job,
)
from mechmon_megatron.detect.pooled_cusum import (
    FamilyThresholds,
    Observation,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
)
from mechmon_megatron.detect.robust_trend import TrendConfig

CFG = SequentialConfig(trend=TrendConfig(warmup=5, min_trend=50, window=50, rel_scale_floor=0.0, abs_scale_floor=0.01))
K = CFG.reference


def _stream(seed, n_checks=60, layers=(1, 2), n_heads=4, onset=30, jump=0.0, ramp=0.0):
    """Per check, per layer and head: 1.0 - noise - a shift from ``onset`` (entropy units)."""
    rng = random.Random(seed)
    out = []
    for i in range(n_checks):
        shift = 0.0 if i < onset else jump + ramp * (i - onset)
        out.append([
            Observation("attn_delta2", L, f"head_{h}", 1.0 - 0.01 * (rng.gauss(0, 1) + shift))
            for L in layers for h in range(n_heads)
        ])
    return out


def _residuals(stream):
    """u_L per check from a detector that never alarms (identical to the judged run up to its
    first alarm when warning == alarm: no test is suspect before it)."""
    never = Thresholds(1e9, 1e9)
    det = PooledCusumDetector({"attn_delta2": FamilyThresholds(never, never)}, CFG)
    out = []
    for i, obs in enumerate(stream):
        stats = det.update(10 * (i + 1), obs).statistics
        out.append({int(k.rsplit("_", 1)[1]): v for k, v in stats.items() if "/residual/layer_" in k})
    return out


def _brute_first_alarm(us, alarm, limit, limit_family, shewhart):
    """(step, level, kind) of the first alarm: CUSUM S = max(0, S + u - k) per layer and on the
    trimmed mean of the layers, plus the Shewhart limit on u itself."""
    s_layer, s_family = {}, 0.0
    for i, u in enumerate(us):
        step = 10 * (i + 1)
        for L in sorted(u):
            s_layer[L] = max(0.0, s_layer.get(L, 0.0) + u[L] - K)
        xs = sorted(u.values())
        cut = int(math.floor(CFG.trim * len(xs)))
        kept = xs[cut: len(xs) - cut] or xs
        u_f = sum(kept) / len(kept) if len(u) > 1 else None
        if u_f is not None:
            s_family = max(0.0, s_family + u_f - K)
        hits = []
        for L in sorted(u):
            if s_layer[L] > alarm:
                hits.append(("layer", "cusum"))
            elif shewhart and u[L] > limit:
                hits.append(("layer", "shewhart"))
        if u_f is not None:
            if s_family > alarm:
                hits.append(("family", "cusum"))
            elif shewhart and u_f > limit_family:
                hits.append(("family", "shewhart"))
        if hits:
            return step, sorted(set(hits))
    return None, []


@pytest.mark.parametrize("seed,jump,ramp", [(1, 0.0, 0.5), (2, 6.0, 0.0), (3, 2.5, 0.2), (4, 0.0, 0.0)])
@pytest.mark.parametrize("shewhart", [False, True])
def test_first_alarm_matches_brute_force(seed, jump, ramp, shewhart):
    stream = _stream(seed, jump=jump, ramp=ramp)
    alarm, limit, limit_family = 9.0, 4.0, 3.0
    levels = FamilyThresholds(Thresholds(alarm, alarm, limit), Thresholds(alarm, alarm, limit_family))
    det = PooledCusumDetector({"attn_delta2": levels}, SequentialConfig(trend=CFG.trend, shewhart=shewhart))
    first, kinds = None, []
    for i, obs in enumerate(stream):
        res = det.update(10 * (i + 1), obs)
        if res.alarms:
            first, kinds = 10 * (i + 1), sorted({(a.level, a.kind) for a in res.alarms})
            break
    want_step, want_kinds = _brute_first_alarm(_residuals(stream), alarm, limit, limit_family, shewhart)
    assert (first, kinds) == (want_step, want_kinds)
    if seed == 2 and shewhart:  # a jump of 6 units: the limit fires at the first faulty check
        assert first == 310 and ("layer", "shewhart") in kinds


def test_option_off_ignores_limits_and_on_needs_them():
    stream = _stream(2, jump=6.0)
    with_limits = FamilyThresholds(Thresholds(9, 9, 0.5), Thresholds(9, 9, 0.5))
    without = FamilyThresholds(Thresholds(9, 9), Thresholds(9, 9))
    a = PooledCusumDetector({"attn_delta2": with_limits}, CFG)
    b = PooledCusumDetector({"attn_delta2": without}, CFG)
    for i, obs in enumerate(stream):
        ra, rb = a.update(10 * (i + 1), obs), b.update(10 * (i + 1), obs)
        assert ra.statistics == rb.statistics and [x.kind for x in ra.alarms] == [x.kind for x in rb.alarms]
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="Shewhart"):
        PooledCusumDetector({"attn_delta2": without}, SequentialConfig(trend=CFG.trend, shewhart=True))


def _table():
    cusum = NullTail(u0=0.5, log_p_u0=math.log(0.05), theta=1.5, theta_hat=2.0, samples=1000, exceedances=50)
    resid = NullTail(u0=1.0, log_p_u0=math.log(0.05), theta=3.0, theta_hat=3.5, samples=1000, exceedances=50)
    fams = ("attn_delta2", "router_weights")
    tails = {5: {f: {"layer": cusum, "family": cusum} for f in fams}}
    return TailTable(tails=tails, shewhart={5: {f: {"layer": resid, "family": resid} for f in fams}})


def test_union_bound_splits_each_test_between_cusum_and_shewhart():
    shape = JobShape(layers={"attn_delta2": 4, "router_weights": 1}, interval=20, overlap=5)
    rate = 0.01
    table = _table()
    out, account = thresholds_for_job(shape, rate, table, shewhart=True)
    tests = (4 + 1) + 1  # four layers and their family test; one router layer (no family test)
    checks = 1e6 / 20
    p = rate / (tests * checks)
    assert account.tests == tests and account.shewhart_share == SHEWHART_SHARE
    cusum, resid = table.tails[5]["attn_delta2"]["layer"], table.shewhart[5]["attn_delta2"]["layer"]
    # Threshold formula, brute force: h = u0 + (log P(S > u0) - log p_test) / theta.
    h = 0.5 + (math.log(0.05) - math.log(p * (1 - SHEWHART_SHARE))) / 1.5
    c = 1.0 + (math.log(0.05) - math.log(p * SHEWHART_SHARE)) / 3.0
    t = out["attn_delta2"].layer
    assert t.alarm == pytest.approx(h) and t.shewhart == pytest.approx(c)
    # The union bound over both tests of every test pair sums to R exactly.
    total = 0.0
    for family, n in shape.layers.items():
        for level, count in (("layer", n), ("family", 1 if n > 1 else 0)):
            lv = getattr(out[family], level)
            pair = math.exp(cusum.log_survival(lv.alarm)) + math.exp(resid.log_survival(lv.shewhart))
            total += count * checks * pair
    assert total == pytest.approx(rate, rel=1e-9)


def test_default_thresholds_and_account_are_unchanged_by_the_option():
    shape = JobShape(layers={"attn_delta2": 4, "router_weights": 1}, interval=20, overlap=5)
    off, account = thresholds_for_job(shape, 0.01, _table())
    assert all(t.layer.shewhart is None and t.family.shewhart is None for t in off.values())
    assert account.shewhart_share is None and "shewhart_share" not in account.to_dict()
    assert all("shewhart" not in lv for levels in account.to_dict()["thresholds"].values() for lv in levels.values())
    plain = TailTable(tails=_table().tails)
    assert "shewhart" not in plain.to_dict()
    assert TailTable.from_dict(_table().to_dict()).shewhart == _table().shewhart
    with pytest.raises(KeyError, match="mechmon-calibrate"):
        thresholds_for_job(shape, 0.01, plain, shewhart=True)
