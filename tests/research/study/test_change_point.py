"""Change-point estimates (research/study/change_point.py): O(n) scans against brute force, planted
shifts and ramps, and the CUSUM last zero against the real detector's alarms."""

import math
import random

import pytest

from mechmon_megatron.detect.pooled_cusum import (
    FamilyThresholds,
    Observation,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
    trimmed_mean,
)
from mechmon_megatron.detect.robust_trend import TrendConfig
from mechmon_megatron.research.study.change_point import (
    cusum_last_zero,
    mean_shift_change_point,
    mean_shift_fit,
    ramp_change_point,
    ramp_fit,
)


# ---------------------------------------------------------------- brute-force references
def brute_mean_shift_llrs(u):
    n = len(u)
    return [max(0.0, math.fsum(u[tau:])) ** 2 / (2 * (n - tau)) for tau in range(n)]


def brute_ramp_llrs(u):
    n = len(u)
    out = []
    for tau in range(n):
        num = math.fsum((t - tau + 1) * u[t] for t in range(tau, n))
        den = sum((t - tau + 1) ** 2 for t in range(tau, n))
        out.append(max(0.0, num) ** 2 / (2 * den))
    return out


def first_argmax(xs):
    return xs.index(max(xs))


def steps_of(n, first=100, interval=20):
    return [first + interval * i for i in range(n)]


def expected_step(steps, tau):
    return None if tau == 0 else steps[tau - 1]


SCANS = [
    (mean_shift_fit, mean_shift_change_point, brute_mean_shift_llrs),
    (ramp_fit, ramp_change_point, brute_ramp_llrs),
]


def random_paths():
    """Gaussian paths of many lengths, some with a planted rise, and all-negative paths."""
    for seed in range(60):
        r = random.Random(seed)
        n = r.randint(1, 120)
        shift_at = r.randint(0, n)
        size = r.choice([0.0, 0.5, 2.0])
        yield [r.gauss(size if t >= shift_at else 0.0, 1.0) for t in range(n)]
    for seed in range(10):
        r = random.Random(1000 + seed)
        yield [-abs(r.gauss(0.0, 1.0)) - 0.01 for _ in range(r.randint(1, 40))]


@pytest.mark.parametrize("fit, change_point, brute", SCANS)
def test_scan_matches_brute_force_on_random_paths(fit, change_point, brute):
    checked_interior = 0
    for u in random_paths():
        llrs = brute(u)
        tau = first_argmax(llrs)
        got = fit(u)
        assert got.index == tau, u
        assert got.llr == pytest.approx(llrs[tau], rel=1e-9, abs=1e-12)
        steps = steps_of(len(u))
        assert change_point(steps, u) == expected_step(steps, tau)
        checked_interior += tau > 0
    assert checked_interior > 20  # most paths exercise the step convention, not only None


@pytest.mark.parametrize("fit, change_point, brute", SCANS)
def test_integer_paths_match_brute_force_exactly(fit, change_point, brute):
    # Integer paths: every sum is exact, so equal LLRs are equal floats in both computations and the
    # earliest-maximiser rule is checked on real ties (frequent for the step model's U^2 / m).
    ties = 0
    for seed in range(300):
        r = random.Random(seed)
        u = [float(r.randint(-1, 2)) for _ in range(r.randint(1, 10))]
        llrs = brute(u)
        best = max(llrs)
        ties += llrs.count(best) > 1 and best > 0
        assert fit(u).index == first_argmax(llrs), u
        assert fit(u).llr == best
    if fit is mean_shift_fit:
        assert ties >= 3  # the seeds do produce ties with a positive LLR


def test_explicit_tie_mean_shift():
    # tau = 1: U = 4, m = 4 -> 2.0; tau = 4: U = 2, m = 1 -> 2.0 (tau 2: 1.5, tau 3: 1.0).
    u = [-9.0, 1.0, 1.0, 0.0, 2.0]
    assert mean_shift_fit(u).llr == 2.0
    assert mean_shift_change_point([10, 20, 30, 40, 50], u) == 10


def test_explicit_tie_ramp():
    # D(13) = 819 = 9 D(6), and here N(1) = 3 N(8): tau = 1 and tau = 8 tie at the largest LLR
    # (integer path, exact sums), so the earliest, tau = 1, wins.
    u = [-20.0, 2.0, 1.0, -1.0, 1.0, 2.0, 0.0, -1.0, 2.0, -2.0, 3.0, 1.0, 3.0, 1.0]
    llrs = brute_ramp_llrs(u)
    assert llrs[1] == llrs[8] == max(llrs)
    assert ramp_fit(u).index == 1
    assert ramp_change_point(steps_of(len(u)), u) == 100


@pytest.mark.parametrize("change_point", [mean_shift_change_point, ramp_change_point])
def test_degenerate_paths(change_point):
    assert change_point([], []) is None
    assert change_point([20], [5.0]) is None  # one value: the shift starts at the first check
    assert change_point([20], [-1.0]) is None
    assert change_point([20, 40, 60], [-1.0, -2.0, -0.5]) is None  # no evidence of a rise: LLR 0 everywhere
    assert change_point([20, 40, 60], [-3.0, 4.0, 4.0]) == 20
    with pytest.raises(ValueError):
        change_point([20, 40], [1.0])


# ---------------------------------------------------------------- planted shifts
ONSET = 60  # index of the first shifted check
SEEDS = range(20)


def test_planted_mean_shift_is_found_within_three_checks():
    # The MLE's error for a 2-sigma step is O(1 / mu^2) checks with geometric tails (a stray value
    # near the change can move it by a few checks), so 3 checks on 90 % of the seeds, not all.
    steps = steps_of(90)
    hits = 0
    for seed in SEEDS:
        r = random.Random(seed)
        u = [r.gauss(0.0, 1.0) for _ in range(ONSET)] + [r.gauss(2.0, 1.0) for _ in range(30)]
        est = mean_shift_change_point(steps, u)
        hits += est is not None and abs(est - steps[ONSET - 1]) <= 3 * 20
    assert hits >= 0.9 * len(SEEDS)


def ramp_path(seed, slope=0.15):
    r = random.Random(10_000 + seed)
    return [r.gauss(0.0, 1.0) for _ in range(ONSET)] + [slope * (j + 1) + r.gauss(0.0, 1.0) for j in range(30)]


def test_planted_ramp_is_found_and_the_mean_shift_lags_it():
    # A ramp's start is less sharply identified than a step's (its first values barely differ from
    # noise): 6 checks on 90 % of the seeds. The step model fits the start late, towards the larger
    # values, which is why the ramp model exists.
    steps = steps_of(90)
    truth = steps[ONSET - 1]
    ramp_err, shift_err, hits = [], [], 0
    for seed in SEEDS:
        u = ramp_path(seed)
        r_est, m_est = ramp_change_point(steps, u), mean_shift_change_point(steps, u)
        assert r_est is not None and m_est is not None
        ramp_err.append(r_est - truth)
        shift_err.append(m_est - truth)
        hits += abs(r_est - truth) <= 6 * 20
    assert hits >= 0.9 * len(SEEDS)
    med = sorted(shift_err)[len(SEEDS) // 2]
    assert med >= 4 * 20  # the step model lags a ramp by several checks
    assert sum(map(abs, ramp_err)) < sum(map(abs, shift_err))


# ---------------------------------------------------------------- the CUSUM last zero
def test_cusum_last_zero_transcribes_the_recurrence():
    steps = [10, 20, 30, 40, 50, 60]
    # S: 0, 2, 0 (zero after the update at 30), 0.5, 0, 3
    u = [0.5, 3.0, -5.0, 1.5, -1.0, 4.0]
    assert cusum_last_zero(steps, u, previous_step=0) == 50  # S was 0 before the update at 60
    assert cusum_last_zero(steps[:4], u[:4], previous_step=0) == 30  # S(30) = 0, then 0.5 at 40
    assert cusum_last_zero(steps[:2], u[:2], previous_step=0) == 10
    assert cusum_last_zero(steps[:1], u[:1], previous_step=7) == 7  # the first update sees S = 0
    assert cusum_last_zero(steps[:2], u[:2]) == 10
    assert cusum_last_zero([10, 20], [0.5, 3.0], reference=0.25) is None  # S > 0 from the first value
    assert cusum_last_zero([], []) is None


CFG = SequentialConfig(trend=TrendConfig(warmup=5, min_trend=50, window=50, rel_scale_floor=0.0, abs_scale_floor=0.01))
WARMUP = 5


def run_detector(seed, layers, levels):
    """Feed noisy heads (4 per layer) with a bump and a late shift to a real detector until it alarms;
    returns the first alarm, the step of the last warm-up check, and the residuals it reported."""
    r = random.Random(seed)
    det = PooledCusumDetector({"attn_delta2": levels}, CFG)
    residuals = {L: [] for L in layers}
    step = 0
    for check in range(200):
        step += 10
        # Head noise sd 0.01 (the pooled residual's sd is about 0.5): no shift, a short bump (a CUSUM
        # excursion that dies), no shift, a shift that alarms within a few checks.
        mean = 0.0 if check < 20 else (2.5 if check < 22 else (0.0 if check < 35 else 4.0))
        if check < WARMUP:
            mean = 0.0
        obs = [
            Observation(family="attn_delta2", layer=L, member=f"head_{h}", value=1.0 - 0.01 * r.gauss(mean, 1.0))
            for L in layers for h in range(4)
        ]
        res = det.update(step, obs)
        for L in layers:
            if f"attn_delta2/residual/layer_{L}" in res.statistics:
                residuals[L].append((step, res.statistics[f"attn_delta2/residual/layer_{L}"]))
        if res.alarms:
            return res.alarms[0], WARMUP * 10, residuals
    raise AssertionError("no alarm")


@pytest.mark.parametrize("seed", range(8))
def test_cusum_last_zero_equals_a_layer_alarms_change_step(seed):
    levels = FamilyThresholds(layer=Thresholds(warning=4.0, alarm=8.0), family=Thresholds(1e9, 1e9))
    alarm, last_warmup, residuals = run_detector(seed, (1,), levels)
    assert alarm.level == "layer" and alarm.kind == "cusum"
    steps, u = zip(*residuals[1])
    assert steps[0] == last_warmup + 10 and steps[-1] == alarm.step
    est = cusum_last_zero(steps, u, CFG.reference, previous_step=last_warmup)
    assert est == alarm.change_step
    assert est != last_warmup  # the path has zeros after its start: the estimate is not trivially the first


@pytest.mark.parametrize("seed", range(8))
def test_cusum_last_zero_equals_a_family_alarms_change_step(seed):
    # The family statistic is the trimmed mean of the layers' residuals (as the evaluation pools them).
    levels = FamilyThresholds(layer=Thresholds(1e9, 1e9), family=Thresholds(warning=3.0, alarm=6.0))
    layers = (1, 2, 3, 4)
    alarm, last_warmup, residuals = run_detector(100 + seed, layers, levels)
    assert alarm.level == "family"
    steps = [s for s, _ in residuals[1]]
    assert all([s for s, _ in residuals[L]] == steps for L in layers)
    u = [trimmed_mean([residuals[L][i][1] for L in layers], CFG.trim) for i in range(len(steps))]
    est = cusum_last_zero(steps, u, CFG.reference, previous_step=last_warmup)
    assert est == alarm.change_step
    assert est != last_warmup
