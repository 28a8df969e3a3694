"""The equal-footing rule calibration: the Gumbel fit is the likelihood's maximum (checked against a
grid), recovers a known law, and leave-one-run-out rejects a sample with an outlying run."""

from __future__ import annotations

import math
import random

import pytest

from mechmon_megatron.research.study.rule_calibration import (
    Gumbel,
    calibrate_rule,
    fit_gumbel,
    leave_one_out,
    per_run_probability,
)


def _draw(law: Gumbel, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [law.mu - law.beta * math.log(-math.log(rng.random())) for _ in range(n)]


def _log_likelihood(xs: list[float], mu: float, beta: float) -> float:
    return sum(-math.log(beta) - (x - mu) / beta - math.exp(-(x - mu) / beta) for x in xs)


def test_the_fit_is_the_likelihood_maximum_on_a_grid():
    xs = _draw(Gumbel(1.8, 0.2), 12, seed=3)
    law = fit_gumbel(xs)
    best = _log_likelihood(xs, law.mu, law.beta)
    for dm in (-0.01, 0.0, 0.01):
        for db in (-0.005, 0.0, 0.005):
            if dm or db:
                assert _log_likelihood(xs, law.mu + dm, law.beta + db) < best


def test_a_large_sample_recovers_its_law_and_quantiles_invert_the_survival():
    law = fit_gumbel(_draw(Gumbel(2.0, 0.25), 4000, seed=1))
    assert law.mu == pytest.approx(2.0, abs=0.02) and law.beta == pytest.approx(0.25, rel=0.05)
    for p in (0.5, 0.01, 1e-4):
        assert law.survival(law.quantile_above(p)) == pytest.approx(p, rel=1e-9)


def test_leave_one_out_rejects_an_outlying_run_and_keeps_a_clean_sample():
    clean = _draw(Gumbel(1.8, 0.2), 11, seed=7)
    kept = calibrate_rule(clean, per_run_probability(0.01, 10_000), resamples=200)
    assert not kept.rejected and kept.bootstrap_interval[0] <= kept.threshold <= kept.bootstrap_interval[1] + 1e-9
    assert kept.threshold > max(clean)  # 1e-4 per run lies beyond every observed maximum
    outlier = clean[:-1] + [clean[0] + 40 * 0.2]
    assert min(leave_one_out(outlier)) * len(outlier) < 0.05


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least 3"):
        fit_gumbel([1.0, 2.0])
    with pytest.raises(ValueError, match="differ"):
        fit_gumbel([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="p must be"):
        Gumbel(0.0, 1.0).quantile_above(1.0)
