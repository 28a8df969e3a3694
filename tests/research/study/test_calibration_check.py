"""Leave-one-run-out check of a calibration (``research/study/calibration_check.py``) on the
committed records: the fold that holds out seed 3 is fitted on seeds 1-2, so it must replay
exactly as the shipped detector does (``null_tails.json`` is the fit of seeds 1-2)."""

import os
import subprocess
import sys

import pytest

from mechmon_megatron.research.study.calibration_check import leave_one_run_out, replays_needed, schedules, summary
from mechmon_megatron.research.study.campaign_data import load_checks
from mechmon_megatron.research.study.campaign_records import load_record
from mechmon_megatron.research.study.shipped_replay import closest_margin, replay_shipped

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
RECORDS = os.path.join(ROOT, "docs", "data", "detector_study")
SEEDS = ("healthy-cosine-seed1", "healthy-cosine-seed2", "healthy-cosine-seed3")

pytestmark = pytest.mark.skipif(not os.path.isdir(RECORDS), reason="docs/data/detector_study not present")


def _path(run_id: str) -> str:
    return os.path.join(RECORDS, f"{run_id}.json.gz")


def test_the_fold_fitted_on_the_calibration_seeds_replays_as_the_shipped_detector():
    ticks: list[int] = []
    held = leave_one_run_out([load_checks(_path(r)) for r in SEEDS], list(SEEDS), 20, 100,
                             on_replay=lambda: ticks.append(1))
    assert len(ticks) == replays_needed(len(SEEDS), 20, 100) == 12  # the progress bar's total
    assert [(h.run, h.interval, h.overlap) for h in held] == [(r, i, o) for i, o in ((20, 5), (100, 1)) for r in SEEDS]
    for h in (h for h in held if h.run == "healthy-cosine-seed3"):
        assert h.fitted_on == ("healthy-cosine-seed1", "healthy-cosine-seed2")
        shipped = replay_shipped(load_record(_path(h.run)), h.interval)
        assert list(h.alarms) == shipped.alarms
        assert (h.closest_family, h.closest) == closest_margin(shipped)
    counts = summary(held)
    assert set(counts) == {"interval 20", "interval 100"} and all(c["runs"] == 3 for c in counts.values())


def test_schedules_and_bad_input():
    assert schedules(20, 100) == [(20, 5, 1), (100, 1, 5)]
    assert schedules(100, 100) == [(100, 1, 1)]
    assert schedules(20, 90) == [(20, 5, 1)]  # 90 is no multiple of 20: no interval = delta schedule
    checks = [load_checks(_path(r)) for r in SEEDS[:2]]
    with pytest.raises(ValueError, match="at least 3 healthy runs, got 2"):
        leave_one_run_out(checks, list(SEEDS[:2]), 20, 100)
    with pytest.raises(ValueError, match="2 runs but 1 names"):
        leave_one_run_out(checks, ["a"], 20, 100)


def test_calibrate_detector_refuses_leave_one_out_with_two_runs():
    tool = os.path.join(ROOT, "tools", "calibrate_detector.py")
    done = subprocess.run([sys.executable, tool, _path(SEEDS[0]), _path(SEEDS[1]), "--interval", "20", "--delta",
                           "100", "--leave-one-out"], capture_output=True, text=True)
    assert done.returncode == 2 and "--leave-one-out needs at least 3 healthy runs" in done.stderr
