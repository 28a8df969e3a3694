"""``tools/bench_detector.py`` runs at a small shape and reports what docs/PERFORMANCE.md records:
both detectors per check, and the whole-job detector while every baseline is young, with and
without the early-phase correction (the shipped moments). Its numbers are timings, not checked here;
its premise is: every timed check is young and lies in a measured phase bin, so the correction runs
on each one."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_detector", ROOT / "tools" / "bench_detector.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_prints_both_comparisons(capsys):
    assert _bench().main(["--layers", "2", "--heads", "2", "--moe-layers", "1", "--checks", "2", "--warmup", "2",
                          "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["young_us_per_check"]) == {"uncorrected", "phase_corrected"}
    assert all(v > 0 for v in result["young_us_per_check"].values())
    assert result["ratio_young_corrected_to_uncorrected"] == pytest.approx(
        result["young_us_per_check"]["phase_corrected"] / result["young_us_per_check"]["uncorrected"])
    assert set(result["us_per_check"]) == {"pooled_cusum", "per_stream_0_1"}


def test_the_young_checks_are_judged_with_the_phase_moments():
    bench = _bench()
    from mechmon_megatron.detect.null_model import load_tail_table
    from mechmon_megatron.detect.phase_moments import select_phase_table

    phase, line = select_phase_table(load_tail_table().phase, bench.YOUNG_INTERVAL, bench.YOUNG_DELTA,
                                     bench.CALIBRATION_SCHEDULE)
    assert phase is not None, line
    rng = random.Random(0)
    checks = [bench.synthetic_check(i, 2, 2, 1, rng) for i in range(1, bench.YOUNG_UNTIMED + bench.YOUNG_TIMED + 1)]
    last = bench.YOUNG_DELTA + bench.YOUNG_INTERVAL * (len(checks) - 1)
    assert last < phase.covered_until()  # every timed check lies in a measured bin
    with pytest.raises(SystemExit, match="fill a baseline window"):
        bench.young_us_per_check(checks * 2, 2, 1)
