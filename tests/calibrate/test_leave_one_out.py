"""Leave-one-run-out check of a calibration (``calibrate/leave_one_out.py``).

On the committed records: the fold that holds out seed 3 is fitted on seeds 1-2, so it must replay
exactly as the shipped detector does (``null_tails.json`` is the fit of seeds 1-2, which
``mechmon-calibrate`` reproduces byte for byte). On synthetic runs: the console script's
``--leave-one-out`` reports every run at both schedules, and refuses fewer than three runs."""

import json
import os
import subprocess
import sys

import pytest

from mechmon_megatron.calibrate.cli import main
from mechmon_megatron.calibrate.fit import schedules
from mechmon_megatron.calibrate.inputs import load_checks
from mechmon_megatron.calibrate.leave_one_out import leave_one_run_out, replays_needed, summary
from mechmon_megatron.calibrate.replay import closest_margin
from mechmon_megatron.detect.phase_moments import TrainingSchedule
from tests.research.study.synthetic import detector_checks

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RECORDS = os.path.join(ROOT, "docs", "data", "detector_study")
SEEDS = ("healthy-cosine-seed1", "healthy-cosine-seed2", "healthy-cosine-seed3")

needs_records = pytest.mark.skipif(not os.path.isdir(RECORDS), reason="docs/data/detector_study not present")


def _path(run_id: str) -> str:
    return os.path.join(RECORDS, f"{run_id}.json.gz")


@needs_records
def test_the_fold_fitted_on_the_calibration_seeds_replays_as_the_shipped_detector():
    from mechmon_megatron.research.study.campaign_records import load_record
    from mechmon_megatron.research.study.shipped_replay import replay_shipped

    ticks: list[int] = []
    # The shipped calibration's schedule: its phase moments are fitted per fold, as mechmon-calibrate does.
    held = leave_one_run_out([load_checks(_path(r)) for r in SEEDS], list(SEEDS), 20, 100,
                             on_replay=lambda: ticks.append(1), schedule=TrainingSchedule(100, "cosine", 2e-3))
    assert len(ticks) == replays_needed(len(SEEDS), 20, 100, phase=True) == 18  # the progress bar's total
    assert [(h.run, h.interval, h.overlap) for h in held] == [(r, i, o) for i, o in ((20, 5), (100, 1)) for r in SEEDS]
    for h in (h for h in held if h.run == "healthy-cosine-seed3"):
        assert h.fitted_on == ("healthy-cosine-seed1", "healthy-cosine-seed2")
        shipped = replay_shipped(load_record(_path(h.run)), h.interval)
        assert list(h.alarms) == shipped.alarms
        assert (h.closest_family, h.closest) == closest_margin(shipped)
    counts = summary(held)
    assert set(counts) == {"interval 20", "interval 100"} and all(c["runs"] == 3 for c in counts.values())


@needs_records
def test_the_calibration_of_seeds_1_and_2_is_the_shipped_table_byte_for_byte(tmp_path, capsys):
    out = tmp_path / "tails.json"
    assert main([_path(SEEDS[0]), _path(SEEDS[1]), "--interval", "20", "--delta", "100", "--out", str(out),
                 "--lr-warmup-iters", "100", "--lr-decay-style", "cosine", "--lr", "2e-3"]) == 0
    shipped = os.path.join(ROOT, "mechmon_megatron", "detect", "null_tails.json")
    with open(shipped, "rb") as f:
        assert out.read_bytes() == f.read()
    result = json.loads(capsys.readouterr().out)
    assert result["runs"] == 2 and result["checks"] == 1000 and "notes" not in result


def test_schedules_and_bad_input():
    assert schedules(20, 100) == [(20, 5, 1), (100, 1, 5)]
    assert schedules(100, 100) == [(100, 1, 1)]
    assert schedules(20, 90) == [(20, 5, 1)]  # 90 is no multiple of 20: no interval = delta schedule
    checks = [_synthetic(seed) for seed in (1, 2)]
    with pytest.raises(ValueError, match="at least 3 healthy runs, got 2"):
        leave_one_run_out(checks, ["a", "b"], 20, 100)
    with pytest.raises(ValueError, match="2 runs but 1 names"):
        leave_one_run_out(checks, ["a"], 20, 100)


def _synthetic(seed: int, steps: int = 6000):
    return [(row["step"], row["scalars"]) for row in detector_checks(steps, seed)]


def _write_runs(tmp_path, seeds) -> list[str]:
    paths = []
    for seed in seeds:
        log_dir = tmp_path / f"healthy-{seed}" / "mechmon"
        log_dir.mkdir(parents=True)
        (log_dir / "mechmon_scalars.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in detector_checks(6000, seed)))
        paths.append(str(log_dir.parent))
    return paths


def test_leave_one_out_on_three_runs_reports_each_run_at_both_schedules(tmp_path, capsys):
    paths = _write_runs(tmp_path, (1, 2, 3))
    assert main([*paths, "--interval", "20", "--delta", "100", "--leave-one-out"]) == 0
    result = json.loads(capsys.readouterr().out)["leave_one_out"]
    names = ["healthy-1", "healthy-2", "healthy-3"]
    assert [(r["run"], r["interval"], r["overlap"]) for r in result["runs"]] == [
        (n, i, o) for i, o in ((20, 5), (100, 1)) for n in names]
    assert all(sorted(r["fitted_on"]) == sorted(set(names) - {r["run"]}) for r in result["runs"])
    assert {k: v["runs"] for k, v in result["summary"].items()} == {"interval 20": 3, "interval 100": 3}


def test_leave_one_out_counts_runs_not_paths(tmp_path, capsys):
    """Three fresh starts appended to one records file are three runs: enough to hold one out."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    rows = [{**row, "run": k} for k, seed in enumerate((1, 2, 3), start=1) for row in detector_checks(6000, seed)]
    (log_dir / "mechmon_scalars.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main([str(log_dir), "--interval", "20", "--delta", "100", "--leave-one-out"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["runs"] == 3
    assert {r["run"] for r in result["leave_one_out"]["runs"]} == {"log#run1", "log#run2", "log#run3"}


def test_the_old_tool_refuses_leave_one_out_with_two_runs(tmp_path):
    """``tools/calibrate_detector.py`` is the console script under its old name: same exit, same line."""
    paths = _write_runs(tmp_path, (1, 2))
    tool = os.path.join(ROOT, "tools", "calibrate_detector.py")
    done = subprocess.run([sys.executable, tool, *paths, "--interval", "20", "--delta", "100", "--leave-one-out"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("mechmon-calibrate: error: --leave-one-out needs at least 3 healthy runs "
                                   "(2 to fit, 1 to hold out), got 2")
