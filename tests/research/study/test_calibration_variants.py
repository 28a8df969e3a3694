"""The research variants of the null-tail fit (``research/study/calibration_variants.py``): the
cluster count against brute force, the declustered bound against the shipped fit, the warning-
freeze replay against the plain null replay, and the leave-one-out wiring on synthetic runs."""

from __future__ import annotations

import itertools
import random

import pytest

from mechmon_megatron.detect.null_model import fit_null_tail
from mechmon_megatron.detect.pooled_cusum import FamilyThresholds, Thresholds, default_sequential_config
from mechmon_megatron.research.study.analysis import RunData
from mechmon_megatron.research.study.calibration_variants import (
    clusters_above,
    compare_variants,
    fit_declustered_tail,
    markdown,
    statistics_under_warnings,
)
from mechmon_megatron.research.study.pooled_replay import FAMILIES, null_statistics
from tests.research.study.synthetic import check_rows

INTERVAL = 20


def _checks(seed: int, steps: int = 3000):
    return RunData.from_rows([], check_rows(steps, interval=INTERVAL, seed=seed)).checks


@pytest.mark.parametrize("seed", range(5))
def test_clusters_above_counts_the_runs_of_groupby(seed):
    rng = random.Random(seed)
    values = [max(0.0, rng.gauss(0.5, 1.0)) for _ in range(500)] + [float("nan"), 3.0]
    brute = sum(1 for above, _ in itertools.groupby(values, key=lambda v: v == v and v > 1.0) if above)
    assert clusters_above(values, 1.0) == brute


def test_declustered_bound_is_the_shipped_one_without_clusters_and_lower_with_them():
    rng = random.Random(7)
    singles = []
    for _ in range(400):  # every excess alone between zeros: k_eff == k
        singles += [rng.expovariate(1.5), 0.0, 0.0]
    plain, declustered = fit_null_tail(singles), fit_declustered_tail(singles)
    assert (declustered.u0, declustered.theta_hat, declustered.log_p_u0) == (plain.u0, plain.theta_hat,
                                                                            plain.log_p_u0)
    assert clusters_above(singles, plain.u0) == plain.exceedances and declustered.theta == pytest.approx(plain.theta)
    clustered = [v for v in singles for _ in range(4)]  # each excursion now lasts four checks
    plain, declustered = fit_null_tail(clustered), fit_declustered_tail(clustered)
    assert declustered.theta_hat == plain.theta_hat and declustered.theta < plain.theta < plain.theta_hat


def test_statistics_with_unreachable_warnings_are_the_null_statistics():
    checks = _checks(1)
    config = default_sequential_config(INTERVAL)
    far = FamilyThresholds(layer=Thresholds(warning=1e9, alarm=1e9), family=Thresholds(warning=1e9, alarm=1e9))
    assert statistics_under_warnings(checks, {f: far for f in FAMILIES}, INTERVAL) == null_statistics([checks], config)


def test_every_variant_runs_leave_one_out_and_names_its_alarms():
    series = [_checks(seed) for seed in (1, 2, 3)]
    results = compare_variants(series, ["a", "b", "c"], INTERVAL, 100, iterations=1)
    assert list(results) == ["shipped", "declustered", "warning-freeze"]
    for held in results.values():
        assert [(h.run, h.interval) for h in held] == [(r, i) for i in (20, 100) for r in ("a", "b", "c")]
    text = markdown(results)
    assert text.count("| shipped |") == 2 and "| warning-freeze | 100 | 3 |" in text
    with pytest.raises(ValueError, match="unknown tail-fit variants.*bogus"):
        compare_variants(series, ["a", "b", "c"], INTERVAL, 100, variants=["bogus"])
