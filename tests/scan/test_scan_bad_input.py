"""The scan's bad input: nothing deleted that mechmon did not write, bad input writes nothing,
a checkpoint left out is listed, the scan refuses what the trainer refuses.

The series is written in-process (tests/scan/synthetic.py: real torch_dist files, no training), and
scanned with ``main`` (what the console script calls) or ``run_scan``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from mechmon_megatron.scan import ScanConfig, main, run_scan
from tests.scan.synthetic import HEADS, write_series

ITERATIONS = [10, 20, 30, 40]
FLAGS = ["--num-attention-heads", str(HEADS), "--layers", "1", "--no-progress"]


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> Path:
    return write_series(tmp_path_factory.mktemp("series") / "run", ITERATIONS)


@pytest.fixture()
def run_dir(series, tmp_path) -> Path:
    """A copy the test may damage, with a training's TensorBoard folder beside the checkpoints."""
    run = tmp_path / "run"
    shutil.copytree(series, run)
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"the training's own events")
    return run


def scan(*args: str) -> int:
    return main([*args, *FLAGS])


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mechmon-scan: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- an --out folder the scan did not make
def test_out_that_is_the_run_folder_is_refused_and_nothing_is_deleted(run_dir, capsys):
    before = tree(run_dir)
    assert scan(str(run_dir), "--out", str(run_dir)) == 2
    line = error_line(capsys)
    assert f"--out '{run_dir}' holds data mechmon-scan did not write (iter_0000010," in line
    assert tree(run_dir) == before  # the training's events and every checkpoint as they were


def test_an_unrelated_folder_keeps_its_outputs(run_dir, tmp_path, capsys):
    other = tmp_path / "results"
    (other / "img").mkdir(parents=True)
    (other / "img" / "plot.png").write_bytes(b"png")
    (other / "report.html").write_text("<p>someone else's</p>")
    (other / "summary.json").write_text("{}")
    before = tree(other)
    assert scan(str(run_dir), "--out", str(other)) == 2
    assert "--out" in error_line(capsys)
    assert tree(other) == before


def test_the_scan_marks_its_folder_and_reruns_into_it(run_dir, tmp_path):
    from mechmon_megatron.scan.outputs.manifest import MANIFEST

    out = tmp_path / "out"
    assert scan(str(run_dir), "--out", str(out)) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["written_by"] == "mechmon-scan"
    assert set(manifest["entries"]) == set(os.listdir(out)) - {MANIFEST, "cache"}
    assert scan(str(run_dir), "--out", str(out)) == 0  # its own folder: replaced


# ------------------------------------------------------------------------ a rate no threshold fits (the scan's side)
def test_scan_refuses_a_rate_no_threshold_fits_and_writes_nothing(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert scan(str(run_dir), "--out", str(out), "--false-alarm-rate", "1e6") == 2
    line = error_line(capsys)
    assert line.startswith("mechmon-scan: error: --false-alarm-rate 1e+06 ") and "use a rate below" in line
    assert "--mechmon" not in line  # the scan's own flag names
    assert not out.exists()


# --------------------------------------------------------------- an --out that cannot be a folder (the scan's side)
@pytest.mark.parametrize("where", ["/proc/x", "file"])
def test_out_that_cannot_be_a_folder_is_refused(run_dir, tmp_path, capsys, where):
    out = where if where.startswith("/") else str(run_dir / "latest_checkpointed_iteration.txt")
    assert scan(str(run_dir), "--out", out) == 2
    line = error_line(capsys)
    assert f"--out '{out}'" in line and ("cannot be written" in line or "is not a directory" in line), line


# ---------------------------------------------------------------------------- a checkpoint left out
def test_a_checkpoint_left_out_is_listed_on_the_console_and_in_the_summary(run_dir, tmp_path, capsys, caplog):
    (run_dir / "iter_0000030" / ".metadata").unlink()
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="mechmon_megatron.scan"):
        assert scan(str(run_dir), "--out", str(out)) == 0
    damaged = str(run_dir / "iter_0000030")
    assert any(damaged in r.getMessage() and "no .metadata" in r.getMessage() for r in caplog.records)
    assert "1 checkpoint folder(s) left out" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoints"] == [10, 20, 40]
    assert summary["skipped_checkpoints"] == [
        {"path": damaged, "reason": "has *.distcp shards but no .metadata: an incomplete or damaged torch_dist save"}]


# ---------------------------------------------------------------------------- a scan stopped part way
def test_staging_left_by_a_killed_scan_is_removed_by_the_next_run(run_dir, tmp_path):
    out = tmp_path / "out"
    assert scan(str(run_dir), "--out", str(out)) == 0
    # What a kill while the outputs were being moved in leaves (staging.py).
    (out / ".staging-abc123" / "tensorboard").mkdir(parents=True)
    (out / ".staging-abc123" / "summary.json").write_text("{}")
    (out / ".old-def456").mkdir()
    assert scan(str(run_dir), "--out", str(out)) == 0
    assert not [n for n in os.listdir(out) if n.startswith((".staging-", ".old-", ".tmp-"))]


@pytest.mark.parametrize("content", ["", '{"tails":{}}'], ids=["empty", "no-tails"])
def test_bad_input_exits_write_nothing_not_even_the_cache(run_dir, tmp_path, capsys, content):
    calibration = tmp_path / "tails.json"
    calibration.write_text(content)
    out = tmp_path / "out"
    assert scan(str(run_dir), "--out", str(out), "--detector-calibration", str(calibration)) == 2
    assert f"--detector-calibration: no usable null-tail table in {calibration}" in error_line(capsys)
    assert not out.exists()


def test_a_scan_stopped_by_bad_input_mid_series_removes_the_folder_it_made(run_dir, tmp_path):
    """The metadata reads, the data does not: found while computing, after the folder was made."""
    for shard in (run_dir / "iter_0000030").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="iter_0000030"):
        run_scan(ScanConfig(inputs=(str(run_dir),), out=str(out), num_attention_heads=HEADS, layers=(1,),
                            progress=False))
    assert not out.exists()


# ---------------------------------------------------------------------------- the early-phase correction's schedule
def test_one_schedule_flag_alone_is_refused_naming_both(series, tmp_path, capsys):
    out = tmp_path / "scan"
    assert scan(str(series), "--out", str(out), "--lr-warmup-iters", "100") == 2
    line = error_line(capsys)
    assert line == ("mechmon-scan: error: --lr-warmup-iters needs --lr-decay-style and --lr too (the phase moments "
                    "hold for one schedule)")
    assert not out.exists()


@pytest.mark.parametrize(("flags", "phrase"), [
    # The series is saved every 10 steps: no calibration has phase moments for that schedule.
    ([], "no phase moments for interval 10 delta 10"),
    (["--lr-warmup-iters", "100", "--lr-decay-style", "cosine", "--lr", "2e-3"],
     "no phase moments for interval 10 delta 10"),
])
def test_the_summary_says_whether_the_early_phase_correction_applies(series, tmp_path, flags, phrase):
    out = tmp_path / "scan"
    assert scan(str(series), "--out", str(out), *flags) == 0
    notes = json.loads((out / "summary.json").read_text())["detector"]["notes"]
    assert sum(phrase in note for note in notes) == 1, notes
