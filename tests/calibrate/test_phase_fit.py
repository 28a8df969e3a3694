"""``mechmon-calibrate``'s phase moments: the learning-rate schedule flags and what they fit.

* ``--lr-warmup-iters`` / ``--lr-decay-style`` / ``--lr``: all three or none (some without the
  others, a negative warm-up, a blank style or a peak learning rate <= 0 exits 2 with one line
  naming the flags, and nothing is written);
* with them, on synthetic healthy runs, the file has a ``phase`` table per schedule it serves, with
  the given learning-rate schedule and exactly the moments of the runs' young residuals; without
  them it has no ``phase`` key;
* ``leave_one_run_out(..., schedule=)`` makes ``replays_needed(n, interval, delta, phase=True)``
  replays (and ``phase=False`` without it).
"""

from __future__ import annotations

import json

import pytest

from mechmon_megatron.calibrate.cli import main
from mechmon_megatron.calibrate.fit import schedules, young_residuals
from mechmon_megatron.calibrate.leave_one_out import leave_one_run_out, replays_needed
from mechmon_megatron.calibrate.replay import subsample
from mechmon_megatron.detect.null_model import TailTable
from mechmon_megatron.detect.phase_moments import MIN_BIN_SAMPLES, PhaseTable, TrainingSchedule, fit_phase_table
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from tests.research.study.synthetic import detector_checks

STEPS = 6000


def _write_runs(tmp_path, seeds, interval=20) -> list[str]:
    paths = []
    for seed in seeds:
        log_dir = tmp_path / f"healthy-{seed}" / "mechmon"
        log_dir.mkdir(parents=True)
        (log_dir / "mechmon_scalars.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in detector_checks(STEPS, seed, interval)))
        paths.append(str(log_dir.parent))
    return paths


def _series(seeds, interval=20):
    return [[(row["step"], row["scalars"]) for row in detector_checks(STEPS, seed, interval)] for seed in seeds]


def _refused(argv, capsys, out) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mechmon-calibrate: error: "), captured.err
    assert not out.exists()
    assert not list(out.parent.glob("tails.json*"))  # no temporary file left either
    return lines[0]


@pytest.mark.parametrize("flags,given,missing", [
    (["--lr-warmup-iters", "100"], "--lr-warmup-iters", "--lr-decay-style and --lr"),
    (["--lr-decay-style", "cosine"], "--lr-decay-style", "--lr-warmup-iters and --lr"),
    (["--lr", "2e-3"], "--lr", "--lr-warmup-iters and --lr-decay-style"),
    (["--lr-warmup-iters", "100", "--lr-decay-style", "cosine"], "--lr-warmup-iters and --lr-decay-style", "--lr"),
])
def test_one_schedule_flag_alone_is_refused(tmp_path, capsys, flags, given, missing):
    paths = _write_runs(tmp_path, (1, 2))
    out = tmp_path / "tails.json"
    line = _refused([*paths, "--interval", "20", "--delta", "100", "--out", str(out), *flags], capsys, out)
    assert f"{given} needs {missing} too" in line


def test_a_negative_warm_up_is_refused(tmp_path, capsys):
    paths = _write_runs(tmp_path, (1, 2))
    out = tmp_path / "tails.json"
    line = _refused([*paths, "--interval", "20", "--delta", "100", "--out", str(out),
                     "--lr-warmup-iters", "-5", "--lr-decay-style", "cosine", "--lr", "2e-3"], capsys, out)
    assert "--lr-warmup-iters must be >= 0" in line and "-5" in line


@pytest.mark.parametrize("peak", ["0", "-0.001", "nan", "inf"])
def test_a_peak_learning_rate_not_above_zero_is_refused(tmp_path, capsys, peak):
    paths = _write_runs(tmp_path, (1, 2))
    out = tmp_path / "tails.json"
    line = _refused([*paths, "--interval", "20", "--delta", "100", "--out", str(out),
                     "--lr-warmup-iters", "100", "--lr-decay-style", "cosine", "--lr", peak], capsys, out)
    assert "--lr must be a finite number > 0" in line


def test_a_blank_decay_style_is_refused(tmp_path, capsys):
    paths = _write_runs(tmp_path, (1, 2))
    out = tmp_path / "tails.json"
    line = _refused([*paths, "--interval", "20", "--delta", "100", "--out", str(out),
                     "--lr-warmup-iters", "100", "--lr-decay-style", " ", "--lr", "2e-3"], capsys, out)
    assert "--lr-decay-style" in line


def test_with_the_schedule_the_file_has_the_phase_moments_of_the_recorded_schedule(tmp_path, capsys):
    """Four runs recorded at interval 20: the phase moments are measured at interval 20 only (at
    interval 100 a bin would hold 5 times fewer residuals: its tails are fitted uncorrected)."""
    seeds = (1, 2, 3, 4)
    paths = _write_runs(tmp_path, seeds)
    out = tmp_path / "tails.json"
    schedule = TrainingSchedule(250, "WSD", 2e-3)
    assert main([*paths, "--interval", "20", "--delta", "100", "--out", str(out),
                 "--lr-warmup-iters", "250", "--lr-decay-style", "WSD", "--lr", "2e-3"]) == 0
    result = json.loads(capsys.readouterr().out)
    data = json.loads(out.read_text())
    assert "250-step warm-up, WSD decay, peak learning rate 0.002" in data["source"]
    phase = data["phase"]
    assert [(p["interval"], p["delta"], p["attention"]) for p in phase] == [(20, 100, "standard")]
    assert all((p["lr_warmup_steps"], p["lr_decay_style"], p["peak_lr"]) == (250, "WSD", 2e-3) for p in phase)
    table = TailTable.from_dict(data)
    series = _series(seeds)
    assert len(table.phase) == 1
    for entry, (interval, overlap, every) in zip(table.phase, schedules(20, 100)[:1]):
        assert entry.schedule == schedule
        runs = series if every == 1 else [subsample(c, 20, every) for c in series]
        expected = fit_phase_table(young_residuals(runs, default_sequential_config(interval)), interval, 100,
                                   schedule)
        assert entry == expected
        assert set(entry.families) == {"attn_delta2", "attn_dw"}
        for bins in entry.families.values():
            assert bins and all(b.samples >= MIN_BIN_SAMPLES and b.scale > 0 for b in bins)
        assert result["fit"][f"phase/{overlap}"] == entry.to_dict()


def test_without_the_schedule_there_is_no_phase_key(tmp_path, capsys):
    paths = _write_runs(tmp_path, (1, 2))
    out = tmp_path / "tails.json"
    assert main([*paths, "--interval", "20", "--delta", "100", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    data = json.loads(out.read_text())
    assert "phase" not in data and "warm-up" not in data["source"]
    assert not any(k.startswith("phase/") for k in result["fit"])
    assert TailTable.from_dict(data).phase == ()


def test_the_moments_change_the_fitted_tails(tmp_path, capsys):
    """The tails of a file with phase moments come from replays that apply them: they differ."""
    paths = _write_runs(tmp_path, (1, 2))
    plain, corrected = tmp_path / "plain.json", tmp_path / "corrected.json"
    assert main([*paths, "--interval", "20", "--delta", "100", "--out", str(plain)]) == 0
    assert main([*paths, "--interval", "20", "--delta", "100", "--out", str(corrected),
                 "--lr-warmup-iters", "100", "--lr-decay-style", "cosine", "--lr", "2e-3"]) == 0
    capsys.readouterr()
    a, b = json.loads(plain.read_text()), json.loads(corrected.read_text())
    assert a["tails"]["5"] != b["tails"]["5"]
    assert a["tails"]["1"] == b["tails"]["1"]  # interval 100: no phase moments, the same fit
    assert [PhaseTable.from_dict(p).schedule for p in b["phase"]] == [TrainingSchedule(100, "cosine", 2e-3)]


@pytest.mark.parametrize("interval,delta", [(20, 100), (100, 100)])
@pytest.mark.parametrize("phase", [True, False])
def test_leave_one_out_makes_the_replays_it_announces(interval, delta, phase):
    series = _series((1, 2, 3), interval)
    ticks: list[int] = []
    held = leave_one_run_out(series, ["a", "b", "c"], interval, delta, on_replay=lambda: ticks.append(1),
                             schedule=TrainingSchedule(100, "cosine", 2e-3) if phase else None)
    assert len(ticks) == replays_needed(3, interval, delta, phase=phase)
    # The recorded schedule's folds refit their phase moments: 3 + 3 x 2 + 3 replays instead of 2 x 3.
    assert len(ticks) == 2 * 3 * len(schedules(interval, delta)) + (3 * 2 if phase else 0)
    assert len(held) == 3 * len(schedules(interval, delta))
