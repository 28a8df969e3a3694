"""What ``mechmon-calibrate`` reads: every form of one run gives the same checks, and one folder of
several launches gives one series per training run (fresh starts apart, resumes joined)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from mechmon_megatron.calibrate.coverage import recorded_interval
from mechmon_megatron.calibrate.inputs import load_named_runs, load_runs, resolve, run_name
from tests.research.study.synthetic import detector_checks

pytest.importorskip("tensorboard")
np = pytest.importorskip("numpy")


def _as_float32(run):
    """A run as TensorBoard stores it: every value a 32-bit float."""
    return [(step, {k: float(np.float32(v)) for k, v in scalars.items()}) for step, scalars in run]


def _checks(rows):
    return [(row["step"], row["scalars"]) for row in rows]


def _write_tensorboard(folder: Path, launches) -> None:
    """One event file per launch, through the session's own TensorBoard writer; the trainer's
    scalars beside mechmon's, as a host's writer holds them."""
    from mechmon_megatron.session.writers import TensorBoardScalarWriter

    for rows in launches:
        writer = TensorBoardScalarWriter.in_directory(str(folder))
        for row in rows:
            writer.write_scalars({**row["scalars"], "lm loss": 2.0}, row["step"])
        writer.close()


@pytest.fixture
def run(tmp_path) -> tuple[Path, list]:
    """``RUN/mechmon/mechmon_scalars.jsonl``, a record of the same checks, and a TensorBoard folder."""
    rows = detector_checks(2000, seed=4)
    log_dir = tmp_path / "pretrain-a" / "mechmon"
    log_dir.mkdir(parents=True)
    (log_dir / "mechmon_scalars.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "pretrain-a.json.gz", "wt", encoding="utf-8") as f:
        json.dump({"version": 1, "run": {}, "checks": rows}, f)
    _write_tensorboard(tmp_path / "pretrain-a" / "tb", [rows])
    return tmp_path, _checks(rows)


def test_every_form_of_one_run_reads_the_same_checks(run):
    root, checks = run
    folder = root / "pretrain-a"
    for path in (folder, folder / "mechmon", folder / "mechmon" / "mechmon_scalars.jsonl", root / "pretrain-a.json.gz"):
        assert load_runs(str(path)) == [checks], path
    (events,) = (folder / "tb").glob("events.out.tfevents.*")
    assert resolve(str(folder / "tb")).kind == "tensorboard"
    assert load_runs(str(folder / "tb")) == load_runs(str(events)) == [_as_float32(checks)]  # same steps and names
    assert {run_name(str(p)) for p in (folder, folder / "mechmon", folder / "mechmon" / "mechmon_scalars.jsonl",
                                       root / "pretrain-a.json.gz")} == {"pretrain-a"}
    assert run_name(str(folder / "tb")) == "tb"


def test_a_log_dir_prefers_its_records_to_its_event_files(tmp_path):
    """Without a host writer the session writes both into --mechmon-log-dir: the JSONL values are exact."""
    rows = detector_checks(400, seed=5)
    (tmp_path / "mechmon_scalars.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _write_tensorboard(tmp_path, [rows])
    assert resolve(str(tmp_path)).kind == "jsonl"
    assert load_runs(str(tmp_path)) == [_checks(rows)]


def test_fresh_starts_in_one_tensorboard_folder_are_separate_runs(tmp_path):
    """As the JSONL records number them: a launch that starts from the first check again is a new
    run; a resume (it starts later) continues its run, a repeated step kept."""
    first = detector_checks(400, seed=1)  # steps 20 .. 400
    resume = [{**r, "step": r["step"] + 380} for r in detector_checks(200, seed=2)]  # 400 .. 580: one repeat
    fresh = detector_checks(200, seed=3)
    _write_tensorboard(tmp_path, [first, resume, fresh])
    runs = load_runs(str(tmp_path))
    assert [[s for s, _ in r] for r in runs] == [sorted([r["step"] for r in first + resume]),
                                                 [r["step"] for r in fresh]]
    series, names = load_named_runs([str(tmp_path)], run_name)
    assert names == [f"{tmp_path.name}#run1", f"{tmp_path.name}#run2"] and series == runs


def test_event_files_of_the_trainer_alone_hold_no_run(tmp_path):
    from mechmon_megatron.calibrate.errors import CalibrationError
    from mechmon_megatron.session.writers import TensorBoardScalarWriter

    writer = TensorBoardScalarWriter.in_directory(str(tmp_path))
    writer.write_scalars({"lm loss": 2.0}, 10)
    writer.close()
    with pytest.raises(CalibrationError, match="hold no mechmon/... scalars.*--mechmon"):
        load_runs(str(tmp_path))


def test_the_recorded_interval_is_the_spacing_of_the_checks():
    assert recorded_interval([(20, {}), (40, {}), (60, {})]) == 20
    assert recorded_interval([(10, {}), (20, {}), (40, {}), (60, {}), (60, {})]) == 10  # a resume at interval 20
    assert recorded_interval([(100, {}), (300, {})]) == 200  # two checks only: their gap
    assert recorded_interval([(20, {}), (20, {})]) is None
