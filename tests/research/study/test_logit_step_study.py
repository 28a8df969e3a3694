"""The per-step logit growth test of the round-6 study (research/study/logit_step_study.py)."""

import decimal
import math
import os
import random
from types import SimpleNamespace

import pytest

from mechmon_megatron.detect.null_model import fit_null_tail
from mechmon_megatron.detect.pooled_cusum import FamilyThresholds, Thresholds
from mechmon_megatron.research.study.logit_step_study import (
    ROUND7_TAIL_RUNS,
    fit_logit_tail,
    group_of,
    healthy_logit_cusums,
    leave_one_out,
    loo_rejects,
    replay_logit,
    resolve_tail_records,
)
from mechmon_megatron.research.study.short_window_plan import (
    THIRD_HELD_OUT_SEEDS,
    plan_short_window_campaign,
    round7_held_out_ids,
    round8_healthy_ids,
    s8_ids,
)


def _series(jump_at=None, factor=3.0, steps=2000, seed=0):
    rng = random.Random(seed)
    out = []
    for step in range(1, steps + 1):
        x = 25.0 * math.exp(rng.gauss(0.0, 0.08))
        if jump_at is not None and step >= jump_at:
            x *= factor
        out.append((step, math.log(x)))
    return out


LEVELS = FamilyThresholds(Thresholds(warning=24.0, alarm=37.0), Thresholds(warning=24.0, alarm=37.0))


def test_quiet_on_a_stationary_stream_and_fast_on_a_jump():
    first, alarms, cusums = replay_logit(_series(), LEVELS)
    assert first is None and alarms == []
    assert len(cusums) == 2000 - 200  # no CUSUM during the 200-step warm-up
    first, _, _ = replay_logit(_series(jump_at=1500), LEVELS, start_step=1500)
    # Clipped residuals (8) and reference 1 add at most 7 per step: >= 6 steps to pass 37.
    assert first is not None and 1505 <= first <= 1515


def test_a_falling_logit_never_alarms():
    first, alarms, _ = replay_logit(_series(jump_at=1500, factor=0.3), LEVELS)
    assert first is None and alarms == []


def test_groups():
    assert group_of("fa-s32-on500-seed2") == "choice"
    assert group_of("fa-s16-on2000-seed5") == "held-out 4-6"
    assert group_of("fa-s32-on500-seed9") == "held-out 7-9"
    assert group_of("fa-s16-on500-seed12") == "held-out 10-12"
    assert group_of("moe-lr-seed1") == "lr"


# Round 7: the per-step tail fitted on named healthy runs, and its leave-one-out check.

def _cusums(scales, n=5000, seed=1):
    """Per run: n null-like values, 0 half the time, else exponential with the run's scale."""
    rng = random.Random(seed)
    return {name: [0.0 if rng.random() < 0.5 else rng.expovariate(1.0 / scale) for _ in range(n)]
            for name, scale in scales.items()}


def test_the_tail_fit_uses_exactly_the_named_runs():
    cusums = _cusums({"a": 1.0, "b": 1.0, "c": 4.0})
    tail = fit_logit_tail(cusums, ["a", "b"])
    assert tail == fit_null_tail(cusums["a"] + cusums["b"])
    assert tail.samples == 10000
    assert fit_logit_tail(cusums, ["a", "b", "c"]).theta < tail.theta  # c's heavy tail would show
    with pytest.raises(KeyError):
        fit_logit_tail(cusums, ["a", "d"])
    with pytest.raises(ValueError):
        fit_logit_tail(cusums, ["a", "a"])


def _record(name, healthy, seed):
    rng = random.Random(seed)
    steps = list(range(1, 601))
    logits = [25.0 * math.exp(rng.gauss(0.0, 0.08)) for _ in steps]
    return SimpleNamespace(name=name, healthy=healthy, data=SimpleNamespace(steps=steps, max_attn_logit=logits))


def test_tail_records_are_the_named_ones_this_campaign_first():
    here = {"healthy-cosine-seed1": _record("here-1", True, 1), "healthy-cosine-seed2": _record("here-2", True, 2),
            "fa-s32-on500-seed1": _record("fault", False, 3)}
    round2 = {"healthy-cosine-seed1": _record("r2-1", True, 4), **{n: _record("r2-" + n, True, 5 + i)
              for i, n in enumerate(ROUND7_TAIL_RUNS[2:])}}
    got = resolve_tail_records(ROUND7_TAIL_RUNS, here, round2)
    assert list(got) == list(ROUND7_TAIL_RUNS)
    assert got["healthy-cosine-seed1"] is here["healthy-cosine-seed1"]  # not the round-2 realisation
    assert [got[n] for n in ROUND7_TAIL_RUNS[2:]] == [round2[n] for n in ROUND7_TAIL_RUNS[2:]]
    with pytest.raises(KeyError):
        resolve_tail_records(["healthy-cosine-seed7"], here, round2)
    with pytest.raises(ValueError):
        resolve_tail_records(["fa-s32-on500-seed1"], here, round2)
    cusums = healthy_logit_cusums(got)
    assert list(cusums) == list(ROUND7_TAIL_RUNS)
    assert all(len(v) == 600 - 200 for v in cusums.values())  # one per step past the warm-up


def _brute_force(cusums, runs, p_step):
    out = []
    for held in runs:
        pooled = []
        for r in runs:
            if r != held:
                pooled.extend(cusums[r])
        tail = fit_null_tail(pooled)
        top = max(cusums[held])
        p = min(1.0, math.exp(tail.log_p_u0 - tail.theta * max(0.0, top - tail.u0)))
        p_ml = min(1.0, math.exp(tail.log_p_u0 - tail.theta_hat * max(0.0, top - tail.u0)))
        n = len(cusums[held])
        with decimal.localcontext() as ctx:  # 1 - (1 - p)^n without float cancellation at p ~ 1e-12
            ctx.prec = 60
            p_max, p_max_ml = (float(1 - (1 - decimal.Decimal(x)) ** n) for x in (p, p_ml))
        out.append((held, tail.threshold(p_step), top, p_max, p_max_ml))
    return out


def test_leave_one_out_against_brute_force_and_its_verdict():
    p_step = 1e-9
    same = _cusums({f"r{i}": 1.0 for i in range(5)})
    checks = leave_one_out(same, list(same), p_step)
    for c, (held, level, top, p_max, p_max_ml) in zip(checks, _brute_force(same, list(same), p_step)):
        assert c.held_out == held and c.fitted_on == tuple(r for r in same if r != held)
        assert c.steps == 5000 and c.max_cusum == top and c.alarm == (top > level)
        assert c.alarm_level == pytest.approx(level, rel=1e-12)
        assert c.p_max == pytest.approx(p_max, rel=1e-9) and c.p_max_ml == pytest.approx(p_max_ml, rel=1e-9)
    assert not loo_rejects(checks) and not any(c.alarm for c in checks)
    # One run with a three times heavier tail: its maximum is far beyond what the other four predict.
    mixed = _cusums({"r0": 1.0, "r1": 1.0, "heavy": 3.0, "r3": 1.0, "r4": 1.0})
    checks = leave_one_out(mixed, list(mixed), p_step)
    for c, (held, level, top, p_max, _) in zip(checks, _brute_force(mixed, list(mixed), p_step)):
        assert c.held_out == held and c.max_cusum == top and c.alarm_level == pytest.approx(level, rel=1e-12)
        assert c.p_max == pytest.approx(p_max, rel=1e-9, abs=1e-300)
    heavy = checks[2]
    assert heavy.held_out == "heavy" and heavy.p_max < 0.01 / 5 and heavy.log10_p_step < -6
    assert loo_rejects(checks)


def test_round7_held_out_runs_are_planned_and_recorded_apart_from_the_choice():
    ids = round7_held_out_ids()
    plan = {r.run_id: r for r in plan_short_window_campaign("calibration.json")}
    assert len(plan) == 75 and set(ids) <= set(plan)
    healthy = [i for i in ids if plan[i].kind == "healthy"]
    faults = [i for i in ids if plan[i].kind == "fault"]
    assert healthy == [f"healthy-cosine-seed{s}" for s in THIRD_HELD_OUT_SEEDS]
    assert all(plan[i].train_iters == 10_000 and plan[i].save_at == (400, 1900) for i in healthy)
    assert len(faults) == 12 and all(plan[i].parent in healthy and plan[i].scenario == "fa" for i in faults)
    assert {(plan[i].fa_strength, plan[i].fault_onset) for i in faults} == {(s, o) for s in (32.0, 16.0)
                                                                            for o in (500, 2000)}
    assert {group_of(i) for i in faults} == {"held-out 10-12"}
    # Trained after the pre-registration was committed (session 11) and committed in turn: every
    # held-out id has its record, and no other record (the runs that chose long+logit5) has a seed of 10-12.
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "data")
    seen = {name[: -len(".json.gz")] for sub in ("short_window_study", "detector_study")
            for name in os.listdir(os.path.join(root, sub)) if name.endswith(".json.gz")}
    assert set(ROUND7_TAIL_RUNS) <= seen and set(ids) <= seen
    others = seen - set(ids)
    assert len(others) > 54 and not {plan[i].seed for i in ids} & {int(s.rsplit("seed", 1)[1]) for s in others}


def test_the_healthy_check_runs_are_new_10000_step_runs_without_forks():
    plan = {r.run_id: r for r in plan_short_window_campaign("calibration.json")}
    ids = round8_healthy_ids()
    assert ids == ["healthy-cosine-seed13", "healthy-cosine-seed14", "healthy-cosine-seed15"]
    assert all(plan[i].kind == "healthy" and plan[i].train_iters == 10_000 for i in ids)
    assert not [r for r in plan.values() if r.parent in ids]
    assert all(r.seed not in (13, 14, 15) for r in plan.values() if r.run_id not in ids)


def test_the_8_ulp_runs_are_forks_of_the_round7_parents_at_400():
    plan = {r.run_id: r for r in plan_short_window_campaign("calibration.json")}
    ids = s8_ids()
    assert ids == ["fa-s8-on500-seed10", "fa-s8-on500-seed11", "fa-s8-on500-seed12"]
    for seed, run_id in zip((10, 11, 12), ids):
        run = plan[run_id]
        assert run.parent == f"healthy-cosine-seed{seed}" and run.fork_at == 400 and run.fault_onset == 500
        assert run.fa_strength == 8.0 and run.train_iters == 3500 and "--mechmon-short-window" in run.flags
    assert not set(ids) & set(round7_held_out_ids())
