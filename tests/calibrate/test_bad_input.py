"""Bad input to ``mechmon-calibrate``: exit status 2, one line on stderr that names the path,
family or flag, no traceback, and no tail table written."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mechmon_megatron.calibrate.cli import main
from mechmon_megatron.detect.pooled_cusum import warmup_checks
from tests.research.study.synthetic import detector_checks

SHIPPED = Path(__file__).resolve().parents[2] / "mechmon_megatron" / "detect" / "null_tails.json"


def _write_jsonl(path: Path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def healthy(tmp_path) -> str:
    """A healthy run long enough to fit at interval 20, delta 100 (300 checks)."""
    return _write_jsonl(tmp_path / "healthy" / "mechmon_scalars.jsonl", detector_checks(6000, seed=7))


def _refused(argv, capsys, *, out: Path | None = None) -> str:
    """Run the console script; it must exit 2 with one line and write nothing. Returns the line."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mechmon-calibrate: error: "), captured.err
    if out is not None:
        assert not out.exists() or out.is_dir()
    return lines[0]


def test_records_too_short_to_fit_a_family_name_it_and_the_checks(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "short" / "mechmon_scalars.jsonl", detector_checks(160, seed=1))  # 8 checks
    out = tmp_path / "tails.json"
    line = _refused([path, "--interval", "20", "--delta", "100", "--out", str(out)], capsys, out=out)
    needs = warmup_checks(20) + 1  # every stream has a value from the first check
    assert f"detector family 'attn_delta2' cannot be fitted at interval 20: a run needs at least {needs} checks" in line
    assert "(short) has 8" in line and "record longer healthy runs" in line


def test_a_second_schedule_too_short_to_fit_is_left_out_with_a_note(tmp_path, capsys):
    """25 checks fit interval 20; every fifth of them (5 checks at interval 100) end before the
    warm-up does: the file serves interval 20, and a job at interval 100 borrows its heavier tails."""
    path = _write_jsonl(tmp_path / "r" / "mechmon_scalars.jsonl", detector_checks(500, seed=2))
    out = tmp_path / "tails.json"
    assert main([path, "--interval", "20", "--delta", "100", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "note: no tails for --mechmon-interval 100 (one check in 5)" in captured.err
    assert f"needs at least {warmup_checks(100) + 1} checks" in captured.err and "(r) has 5" in captured.err
    assert list(json.loads(out.read_text())["tails"]) == ["5"]
    assert json.loads(captured.out)["notes"][0].startswith("no tails for --mechmon-interval 100")


def test_an_existing_out_needs_force(healthy, tmp_path, capsys):
    out = tmp_path / "tails.json"
    out.write_text("keep me")
    line = _refused([healthy, "--interval", "20", "--delta", "100", "--out", str(out)], capsys)
    assert "the file exists; pass --force" in line and out.read_text() == "keep me"
    assert main([healthy, "--interval", "20", "--delta", "100", "--out", str(out), "--force"]) == 0
    assert "shewhart" in json.loads(out.read_text())


def test_out_must_not_be_a_folder_or_in_a_missing_one(healthy, tmp_path, capsys):
    line = _refused([healthy, "--interval", "20", "--delta", "100", "--out", str(tmp_path)], capsys)
    assert "is a folder" in line
    line = _refused([healthy, "--interval", "20", "--delta", "100", "--out", str(tmp_path / "no" / "t.json")],
                    capsys)
    assert "does not exist" in line


def test_unrelated_files_are_refused_naming_them(tmp_path, capsys):
    pretty = tmp_path / "null_tails.json"
    pretty.write_text(SHIPPED.read_text())  # a tail table passed where records belong
    one_line = tmp_path / "config.json"
    one_line.write_text(json.dumps({"interval": 20}) + "\n")
    gz = tmp_path / "other.json.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        json.dump({"interval": 20}, f)
    for path in (pretty, one_line, gz):
        line = _refused([str(path), "--interval", "20", "--delta", "100"], capsys)
        assert str(path) in line, line


def test_a_truncated_record_is_refused(tmp_path, capsys):
    whole = tmp_path / "whole.json.gz"
    with gzip.open(whole, "wt", encoding="utf-8") as f:
        json.dump({"version": 1, "checks": detector_checks(2000, seed=3)}, f)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # a copy that stopped half way
    line = _refused([str(cut), "--interval", "20", "--delta", "100"], capsys)
    assert str(cut) in line and "truncated or corrupt" in line


def test_records_of_another_interval_are_refused_naming_both(healthy, capsys):
    line = _refused([healthy, "--interval", "10", "--delta", "100"], capsys)
    assert "checks are 20 steps apart" in line and "--mechmon-interval 20, not --interval 10" in line


def test_a_missing_path_is_refused(healthy, tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    line = _refused([healthy, str(missing), "--interval", "20", "--delta", "100"], capsys)
    assert line.endswith(f"{missing}: no such file or folder")


@pytest.mark.parametrize("flags, message", [
    (["--interval", "0", "--delta", "100"], "--interval must be >= 1 (steps), got 0"),
    (["--interval", "20", "--delta", "-5"], "--delta must be >= 1 (steps), got -5"),
    (["--interval", "20", "--delta", "100", "--rate", "0"], "--rate must be a finite number > 0"),
])
def test_flags_out_of_range_are_refused_naming_the_flag(healthy, capsys, flags, message):
    assert message in _refused([healthy, *flags], capsys)


def test_a_folder_without_records_is_refused(tmp_path, capsys):
    line = _refused([str(tmp_path), "--interval", "20", "--delta", "100"], capsys)
    assert "no mechmon_scalars.jsonl, mechmon/mechmon_scalars.jsonl or TensorBoard event files" in line


def test_the_console_script_exits_2_without_a_traceback(tmp_path):
    """The process itself (``python -m``), not only ``main``: one line, status 2."""
    done = subprocess.run([sys.executable, "-m", "mechmon_megatron.calibrate", str(tmp_path / "nothing"),
                           "--interval", "20", "--delta", "100"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"mechmon-calibrate: error: {tmp_path / 'nothing'}: no such file or folder"
