"""The calibration misfit counter: the Poisson tail against brute force, a heavy-tailed stream
(the counter fires) and a light-tailed one (it does not), and its place in the detector."""

import math
import random
from fractions import Fraction

import pytest

from mechmon_megatron.detect.misfit import MISFIT_P_VALUE, MisfitCounter, poisson_upper_tail
from mechmon_megatron.detect.null_model import fit_null_tail
from mechmon_megatron.detect.pooled_cusum import (
    FamilyThresholds,
    Observation,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
)
from mechmon_megatron.detect.robust_trend import TrendConfig


@pytest.mark.parametrize("k,mean", [(0, 0.5), (1, 0.02), (2, 0.02), (3, 0.5), (5, 4.0), (12, 3.0), (40, 10.0)])
def test_poisson_upper_tail_matches_brute_force(k, mean):
    # Exact 1 - CDF with rational arithmetic on a rational stand-in for e^-mean.
    cdf = sum(Fraction(math.exp(-mean)) * Fraction(mean) ** j / math.factorial(j) for j in range(k))
    assert poisson_upper_tail(k, mean) == pytest.approx(float(1 - cdf), rel=1e-6, abs=1e-15)


def _cusum_upcrossings(increments, warning, k=1.0):
    s, out = 0.0, []
    for u in increments:
        before = s
        s = max(0.0, s + u - k)
        out.append(int(before <= warning < s))
    return out


def _cusum_values(increments, k=1.0):
    s, out = 0.0, []
    for u in increments:
        s = max(0.0, s + u - k)
        out.append(s)
    return out


def _student_t(rng, df):
    return rng.gauss(0, 1) / math.sqrt(rng.gammavariate(df / 2, 2) / df)


def _run_counter(increments, warning, p_warning):
    counter = MisfitCounter(p_warning)
    fired_at = None
    for i, up in enumerate(_cusum_upcrossings(increments, warning)):
        if counter.count("attn_delta2", 1, up) and fired_at is None:
            fired_at = i
    return counter, fired_at


def test_heavy_tailed_stream_fires_and_light_tailed_does_not():
    rng = random.Random(7)
    p_warning = 1e-3
    # Calibrate on a light-tailed (Gaussian) healthy stream, as mechmon-calibrate would.
    calibration = [rng.gauss(0, 1) for _ in range(20_000)]
    warning = fit_null_tail(_cusum_values(calibration)).threshold(p_warning)
    light = [rng.gauss(0, 1) for _ in range(20_000)]
    counter, fired = _run_counter(light, warning, p_warning)
    assert fired is None and not counter.fired("attn_delta2")
    assert counter.statistics("attn_delta2")["attn_delta2/calibration_misfit"] == 0.0
    # Same variance scale, Student-t with 2.5 degrees of freedom: a much heavier tail.
    heavy = [_student_t(rng, 2.5) for _ in range(20_000)]
    counter, fired = _run_counter(heavy, warning, p_warning)
    stats = counter.statistics("attn_delta2")
    assert fired is not None and stats["attn_delta2/calibration_misfit"] == 1.0
    assert poisson_upper_tail(int(stats["attn_delta2/calibration_misfit/observed"]), stats[
        "attn_delta2/calibration_misfit/expected"]) < MISFIT_P_VALUE


CFG = SequentialConfig(trend=TrendConfig(warmup=5, min_trend=50, window=50, rel_scale_floor=0.0, abs_scale_floor=0.01))


def test_detector_writes_the_misfit_once_and_saves_it():
    """A layer whose residual keeps crossing a (too low) warning level: the misfit fires once,
    its scalars are written every check, and the count survives state_dict."""
    levels = FamilyThresholds(Thresholds(1.5, 1e9), Thresholds(1.5, 1e9))
    det = PooledCusumDetector({"attn_delta2": levels}, CFG, warning_probability=1e-4)
    fired = []
    for i in range(200):
        z = 4.0 if i >= 5 and i % 4 == 0 else -3.0  # a burst every 4th check, then back below zero
        obs = [Observation("attn_delta2", 1, f"head_{h}", 1.0 - 0.01 * z) for h in range(4)]
        res = det.update(10 * (i + 1), obs)
        fired += res.misfits
        assert "attn_delta2/calibration_misfit/expected" in res.statistics or i < 5
    assert fired == ["attn_delta2"]
    state = det.state_dict()
    again = PooledCusumDetector({"attn_delta2": levels}, CFG, warning_probability=1e-4)
    again.load_state_dict(state)
    assert again.state_dict() == state and again.misfit is not None and again.misfit.fired("attn_delta2")
    off = PooledCusumDetector({"attn_delta2": levels}, CFG)
    off.load_state_dict(state)  # a state with a misfit section loads where the counter is off
    assert "misfit" not in off.state_dict()
