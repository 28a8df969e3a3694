"""What the terminal says about the detector and the records, on the real example trainer (CPU).

Four launches of one tiny GPT-MoE into one ``--mechmon-log-dir`` (about 10 s each):

A. fresh, interval 10, delta 20, to step 230, saving at 200: the start-up line predicts the step
   of the first ``mechmon/detect/*`` scalar (read back from TensorBoard), and one line says when
   the detector armed;
B. resume from step 200 with ``--mechmon-delta 10``: the checkpoint's baselines are dropped, one
   line says so and when the detector arms again, and it does then;
C. resume from step 200 with ``--mechmon-interval 20`` (same delta): the baselines are kept, so
   the first check with values already has detector statistics;
D. a fresh start into the same log dir: a new run there, one line says so; the records loader of
   calibration reads two runs (A, B and C are one: resumes continue their run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--ffn-hidden-size", "64", "--micro-batch-size", "2", "--corpus-max-bytes", "200000", "--seed", "3",
        "--num-experts", "4", "--moe-router-topk", "2"]
DETECT = "mechmon/detect/"


def _train(log_dir: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "gpt_trainer", *TINY, "--mechmon", "--mechmon-log-dir", str(log_dir), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def _lines(output: str, text: str) -> list[str]:
    return [line[line.index("[mechmon]"):] for line in output.splitlines() if text in line and "[mechmon]" in line]


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "mechmon_scalars.jsonl").read_text().splitlines()]


def _first_detect_step(rows: list[dict]) -> int:
    return next(r["step"] for r in rows if any(k.startswith(DETECT) for k in r["scalars"]))


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("arming")
    log, ckpt = root / "log", root / "ckpt"
    out: dict = {"log": log}
    out["A"] = _train(log, "--mechmon-interval", "10", "--mechmon-delta", "20", "--train-iters", "230",
                      "--save", str(ckpt), "--save-interval", "200")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log))
    events.Reload()
    detect_tags = [t for t in events.Tags()["scalars"] if t.startswith(DETECT)]
    out["A_tensorboard_first"] = min((e.step for t in detect_tags for e in events.Scalars(t)), default=None)
    out["A_rows"] = len(_rows(log))
    resume = ["--load", str(ckpt), "--ckpt-step", "200"]
    out["B"] = _train(log, "--mechmon-interval", "10", "--mechmon-delta", "10", "--train-iters", "420", *resume)
    out["B_rows"] = _rows(log)[out["A_rows"]:]
    out["C"] = _train(log, "--mechmon-interval", "20", "--mechmon-delta", "20", "--train-iters", "240", *resume)
    out["C_rows"] = _rows(log)[out["A_rows"] + len(out["B_rows"]):]
    (root / "before_D.jsonl").write_text((log / "mechmon_scalars.jsonl").read_text())
    out["before_D"] = root / "before_D.jsonl"
    out["D"] = _train(log, "--mechmon-interval", "10", "--mechmon-delta", "10", "--train-iters", "20")
    return out


def test_the_start_up_line_says_when_the_detector_arms_and_it_does(launches):
    out = launches["A"]
    predicted = _lines(out, "detector arms at step")
    assert len(predicted) == 1, out[-4000:]
    step = int(re.search(r"detector arms at step (\d+):", predicted[0]).group(1))
    # warm-up: max(5, ceil(200 / 10)) = 20 checks; routers have values from step 10 -> 10 + 20 * 10
    assert step == 210
    assert "needs 20 checks" in predicted[0] and "routers at step 10" in predicted[0]
    assert "Delta2/dW at step 20 (a snapshot --mechmon-delta 20 steps old)" in predicted[0]
    assert launches["A_tensorboard_first"] == step  # the first mechmon/detect/* scalar, read back
    armed = _lines(out, "detector armed at step")
    assert armed == [f"[mechmon] detector armed at step {step} (first mechmon/detect/* statistics: router_entropy, "
                     "router_weights)"]
    assert f"judged from step {step} (after the baselines' warm-up)" in _lines(out, "alarm thresholds")[0]


def test_a_resume_with_another_delta_restarts_the_baselines(launches):
    # no snapshot survives the restart: first values at 210, then 20 checks of warm-up
    assert _first_detect_step(launches["B_rows"]) == 410
    out = launches["B"]
    lines = _lines(out, "resumed with")
    assert len(lines) == 1, out[-4000:]
    assert lines[0].startswith("[mechmon] resumed with --mechmon-delta 10 (checkpoint: 20): detector baselines "
                               "restart, armed again at step 410: ")
    assert not _lines(out, "detector arms at step")  # the one line says it
    assert _lines(out, "detector armed at step") == [
        "[mechmon] detector armed at step 410 (first mechmon/detect/* statistics: router_entropy, router_weights)"]


def test_a_resume_with_another_interval_keeps_the_baselines(launches):
    out = launches["C"]
    lines = _lines(out, "resumed with")
    assert len(lines) == 1, out[-4000:]
    assert lines[0].startswith("[mechmon] resumed with --mechmon-interval 20 (checkpoint: 10), same --mechmon-delta "
                               "20: detector baselines kept")
    assert "armed at step 220:" in lines[0]
    rows = launches["C_rows"]
    assert rows[0]["step"] == 220 and _first_detect_step(rows) == 220  # the first check after the resume judges


def test_fresh_starts_into_one_log_dir_are_separate_runs(launches):
    from mechmon_megatron.calibrate.inputs import load_checks, load_runs

    log = launches["log"]
    records = str(log / "mechmon_scalars.jsonl")
    with pytest.raises(ValueError, match="holds 2 runs"):  # never one series of two trainings
        load_checks(records)

    # A, then two resumes (one repeating steps 210-230 after the rollback to 200): one run
    (run,) = load_runs(str(launches["before_D"]))
    steps = [step for step, _ in run]
    assert steps == sorted(steps) and steps.count(220) == 3 and steps[-1] == 420
    for name in ("A", "B", "C"):
        assert not _lines(launches[name], "a new run in a used log dir"), name
    new = _lines(launches["D"], "a new run in a used log dir")
    assert new == [f"[mechmon] a new run in a used log dir: records appended as run 2 in {log} (a fresh start, no "
                   "monitor state loaded; the rows before it are run 1; tools that read the records split the runs)"]
    first, second = load_runs(records)
    assert first == run and [step for step, _ in second] == [10, 20]
    markers = [json.loads(line) for line in (log / "mechmon_runs.jsonl").read_text().splitlines()]
    assert [(m["run"], m["start_iteration"], m["resumed"], m["interval"], m["delta"]) for m in markers] == [
        (1, 0, False, 10, 20), (1, 200, True, 10, 10), (1, 200, True, 20, 20), (2, 0, False, 10, 10)]
    # calibration reads the file's runs as separate series
    completed = subprocess.run([sys.executable, "-m", "mechmon_megatron.calibrate", records, "--interval", "10",
                                "--delta", "10"], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads(completed.stdout)
    assert summary["runs"] == 2 and summary["checks"] == len(first) + len(second)


def test_the_launches_event_files_split_into_the_same_runs(launches):
    """The four launches' TensorBoard files in the log dir: resumes join run 1, the fresh start is
    run 2, with the records' steps and names (values as float32, as TensorBoard keeps them)."""
    import numpy as np

    from mechmon_megatron.calibrate.inputs import load_runs
    from mechmon_megatron.calibrate.tensorboard_events import event_files, read_event_runs

    log = str(launches["log"])
    assert len(event_files(log)) == 4
    events = read_event_runs(log, event_files(log))
    records = load_runs(log)  # the folder's JSONL records, preferred to its events
    assert [[s for s, _ in run] for run in events] == [[s for s, _ in run] for run in records]
    rounded = [[(s, {k: float(np.float32(v)) for k, v in sc.items()}) for s, sc in run] for run in records]
    assert json.dumps(events, sort_keys=True) == json.dumps(rounded, sort_keys=True)  # text: NaN == NaN
