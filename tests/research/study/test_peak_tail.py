"""The GPD peak tail of the round-7 addendum against brute force and known distributions."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from mechmon_megatron.research.study.peak_tail import (
    cluster_peaks,
    fit_gpd,
    fit_peak_tail,
    gpd_log_likelihood,
    gpd_survival,
    peak_tail_check,
    xi_lower_bound,
)


def _gpd_sample(rng: random.Random, n: int, xi: float, sigma: float) -> list[float]:
    """Inverse CDF: Y = sigma / xi ((1 - U)^(-xi) - 1)."""
    out = []
    for _ in range(n):
        u = rng.random()
        out.append(-sigma * math.log1p(-u) if xi == 0 else sigma / xi * ((1 - u) ** (-xi) - 1))
    return out


def test_cluster_peaks_match_groupby():
    rng = random.Random(3)
    for _ in range(200):
        values = [rng.choice([0.0, 0.5, 1.0, 1.5, 3.0, 7.0, math.nan]) for _ in range(rng.randint(0, 40))]
        expected = [max(g) for above, g in itertools.groupby(values, key=lambda x: math.isfinite(x) and x > 1.0)
                    if above]
        assert cluster_peaks(values) == expected


@pytest.mark.parametrize("xi,sigma", [(0.0, 1.0), (0.3, 1.5), (0.6, 1.1)])
def test_fit_recovers_known_gpd(xi, sigma):
    y = _gpd_sample(random.Random(7), 4000, xi, sigma)
    xi_hat, sigma_hat = fit_gpd(y)
    assert abs(xi_hat - xi) < 0.07 and abs(sigma_hat / sigma - 1) < 0.1
    lower = xi_lower_bound(y)
    assert lower <= xi_hat and lower > xi - 0.15
    # The fit is the maximum: no grid point nearby is better.
    best = gpd_log_likelihood(np.asarray(y), xi_hat, sigma_hat)
    for dx, ds in itertools.product((-0.02, 0.02), (0.97, 1.03)):
        assert gpd_log_likelihood(np.asarray(y), xi_hat + dx, sigma_hat * ds) <= best + 1e-6


def test_fit_needs_ten_excesses():
    with pytest.raises(ValueError, match="at least 10"):
        fit_gpd([1.0] * 9)


def test_level_inverts_the_per_step_probability_and_checks_leave_one_out():
    rng = random.Random(11)
    # Three runs of CUSUM-like series: excursions from 0 with GPD peaks, 2,000 steps each.
    cusums = {}
    for r in ("a", "b", "c"):
        series = []
        while len(series) < 2000:
            peak = 1.0 + _gpd_sample(rng, 1, 0.3, 2.0)[0]
            series += [0.0] * rng.randint(3, 30) + [peak / 2, peak, peak / 2]
        cusums[r] = series[:2000]
    tail = fit_peak_tail(cusums, ["a", "b", "c"])
    for p in (1e-4, 1e-7, 1e-10):
        h = tail.level(p)
        assert h > tail.u and math.isclose(tail.p_step(h), p, rel_tol=1e-9)
    assert tail.lightest().level(1e-10) <= tail.level(1e-10)
    assert tail.p_max(tail.u + 1, 1000) == pytest.approx(-math.expm1(-1000 * tail.rate * gpd_survival(1, tail.xi,
                                                                                                       tail.sigma)))
    checks = peak_tail_check(cusums, ["a", "b", "c"], ["a", "b"], 1e-10)
    for c in checks:  # each against the tail of the other two
        other = fit_peak_tail(cusums, [r for r in ("a", "b", "c") if r != c.held_out])
        assert c.xi == other.xi and c.alarm_level == other.level(1e-10)
        assert c.max_cusum == max(cusums[c.held_out])
