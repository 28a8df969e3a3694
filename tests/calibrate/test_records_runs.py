"""Runs in one records file (``session/runs.py``): numbering by the JSONL writer, splitting by the
loader of calibration (``calibrate.inputs.load_runs``); a file without run numbers loads as before."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from mechmon_megatron.calibrate.inputs import load_checks, load_named_runs, load_runs
from mechmon_megatron.research.study.analysis import RunData, read_jsonl
from mechmon_megatron.session.runs import RUNS_FILE, last_record
from mechmon_megatron.session.writers import JsonlScalarWriter

RECORD = Path(__file__).resolve().parents[2] / "docs" / "data" / "detector_study" / "healthy-cosine-seed1.json.gz"


def test_a_records_file_without_run_numbers_loads_exactly_as_before(tmp_path):
    with gzip.open(RECORD, "rt", encoding="utf-8") as f:
        rows = json.load(f)["checks"]  # the run's mechmon_scalars.jsonl rows, as the session wrote them
    assert rows and all("run" not in row for row in rows)
    path = tmp_path / "mechmon_scalars.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    before = RunData.from_rows([], read_jsonl(str(path))).checks  # what the loader returned before run numbers
    assert load_checks(str(path)) == before
    assert load_runs(str(path)) == [before]
    assert load_runs(str(RECORD)) == [load_checks(str(RECORD))] and load_checks(str(RECORD)) == before


def _launch(directory: Path, resumed: bool, steps: range, start: int = 0) -> int:
    writer = JsonlScalarWriter(str(directory / "mechmon_scalars.jsonl"))
    marker = writer.start_run("id", start, resumed, 10, 10)
    for step in steps:
        writer.write_scalars({"mechmon/x": float(step)}, step)
    writer.close()
    return marker.run


def test_fresh_starts_number_new_runs_and_resumes_continue_theirs(tmp_path):
    assert _launch(tmp_path, False, range(10, 40, 10)) == 1
    assert _launch(tmp_path, True, range(20, 50, 10), start=10) == 1  # a rollback to 10: 20, 30 again
    assert _launch(tmp_path, False, range(10, 30, 10)) == 2
    assert _launch(tmp_path, False, range(0)) == 3  # a fresh start that wrote nothing before it stopped
    assert _launch(tmp_path, True, range(30, 40, 10), start=20) == 2  # resumes the last run that wrote records
    first, second = load_runs(str(tmp_path / "mechmon_scalars.jsonl"))
    assert [s for s, _ in first] == [10, 20, 20, 30, 30, 40]  # sorted by step, repeats kept (as before)
    assert [s for s, _ in second] == [10, 20, 30]
    series, names = load_named_runs([str(tmp_path / "mechmon_scalars.jsonl")], lambda p: "h")
    assert names == ["h#run1", "h#run2"] and series == [first, second]
    markers = [json.loads(line) for line in (tmp_path / RUNS_FILE).read_text().splitlines()]
    assert [(m["run"], m["resumed"], m["previous_run"]) for m in markers] == [
        (1, False, None), (1, True, 1), (2, False, 1), (3, False, 2), (2, True, 2)]


def test_old_records_then_a_fresh_start_is_run_two(tmp_path):
    path = tmp_path / "mechmon_scalars.jsonl"
    path.write_text(json.dumps({"step": 10, "scalars": {"mechmon/x": 1.0}}) + "\n")  # before run numbers
    assert _launch(tmp_path, False, range(10, 20, 10)) == 2
    assert [[s for s, _ in run] for run in load_runs(str(path))] == [[10], [10]]
    with pytest.raises(ValueError, match="holds 2 runs"):
        load_checks(str(path))


def test_the_last_record_is_read_from_the_end_past_a_torn_line(tmp_path):
    path = tmp_path / "mechmon_scalars.jsonl"
    assert last_record(str(path)) is None
    big = {f"mechmon/s{k}": float(k) for k in range(6000)}  # rows longer than the 64 KiB block read
    with open(path, "w", encoding="utf-8") as f:
        for step in (10, 20, 30):
            f.write(json.dumps({"step": step, "scalars": big, "run": step // 10}) + "\n")
        f.write('{"step": 40, "scalars": {"mech')  # a run killed while writing
    row = last_record(str(path))
    assert row is not None and row["step"] == 30 and row["run"] == 3
    path.write_text("")
    assert last_record(str(path)) is None
