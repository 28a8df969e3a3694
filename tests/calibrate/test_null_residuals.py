"""The Shewhart null statistics: per-check u_L and u_F of a healthy replay, against brute force."""

import math
import random

import pytest

from mechmon_megatron.calibrate.fit import calibrate_on_runs, null_residuals
from mechmon_megatron.detect.pooled_cusum import SequentialConfig
from mechmon_megatron.detect.robust_trend import TrendConfig

CFG = SequentialConfig(trend=TrendConfig(warmup=5, min_trend=50, window=50, rel_scale_floor=0.0, abs_scale_floor=0.01))


def _checks(seed, n=80, layers=3, heads=4):
    rng = random.Random(seed)
    return [
        (20 * (i + 1), {f"mechmon/attn/delta2_entropy/layer_{L}/head_{h}": 1.0 + 0.01 * rng.gauss(0, 1)
                        for L in range(1, layers + 1) for h in range(heads)})
        for i in range(n)
    ]


def test_family_residual_is_the_trimmed_mean_of_the_layer_residuals():
    checks = _checks(1)
    stats = null_residuals([checks], CFG)["attn_delta2"]
    per_check = [stats["layer"][i: i + 3] for i in range(0, len(stats["layer"]), 3)]
    assert len(per_check) == len(stats["family"]) == 80 - 5  # warm-up checks have no residual
    for us, u_f in zip(per_check, stats["family"]):
        xs = sorted(us)
        cut = int(math.floor(CFG.trim * len(xs)))
        kept = xs[cut: len(xs) - cut] or xs
        assert u_f == pytest.approx(sum(kept) / len(kept))


def test_calibration_writes_a_shewhart_section_only_when_asked():
    runs = [_checks(s, n=300) for s in (2, 3)]
    plain, _ = calibrate_on_runs(runs, 20, 100)
    table, log = calibrate_on_runs(runs, 20, 100, shewhart=True)
    assert not plain.shewhart and "shewhart" not in plain.to_dict()
    assert set(table.shewhart) == {5, 1} and table.to_dict()["tails"] == plain.to_dict()["tails"]
    tail, note = table.shewhart_tail(5, "attn_delta2", "family")
    assert note == "" and tail.exceedances >= 20 and any(k.startswith("shewhart/5/attn_delta2") for k in log)
