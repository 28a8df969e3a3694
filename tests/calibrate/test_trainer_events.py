"""A real healthy run of the example trainer (CPU, about 20 s of training on an idle core):
calibrating from its TensorBoard events gives the fit of its ``mechmon_scalars.jsonl``.

TensorBoard keeps each value as a 32-bit float (the JSONL records keep the session's 64-bit
floats), so the fit from the events is exactly the fit from the records rounded to float32, and
equal to the fit from the records themselves up to that rounding: the same tests, counts and
fallbacks, every fitted number within a relative 1e-4 (the float32 rounding of the inputs, 6e-8,
grows through the robust scales and the tail fit: up to 2e-5 measured on megatron-core 0.19).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mechmon_megatron.calibrate.cli import main
from mechmon_megatron.calibrate.fit import calibrate
from mechmon_megatron.calibrate.inputs import load_runs

pytest.importorskip("megatron.core")
pytest.importorskip("tensorboard")
np = pytest.importorskip("numpy")

INTERVAL, DELTA = 10, 20
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--ffn-hidden-size", "64", "--micro-batch-size", "2", "--corpus-max-bytes", "200000", "--seed", "3",
        "--num-experts", "4", "--moe-router-topk", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """``RUN/tb`` (the trainer's TensorBoard writer, which mechmon writes into) and ``RUN/mechmon``
    (``--mechmon-log-dir``: the JSONL records): 800 steps, 80 checks (60 after the warm-up: 40 left
    the layer-level Delta2 test without one healthy excursion to fit on megatron-core 0.19)."""
    run = tmp_path_factory.mktemp("calibrate") / "pretrain-a"
    cmd = [sys.executable, "-m", "gpt_trainer", *TINY, "--train-iters", "800", "--mechmon",
           "--mechmon-per-head-scalars", "--mechmon-interval", str(INTERVAL), "--mechmon-delta", str(DELTA),
           "--tensorboard-dir", str(run / "tb"), "--mechmon-log-dir", str(run / "mechmon")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return run


def _rounded(run):
    return [(step, {k: float(np.float32(v)) for k, v in scalars.items()}) for step, scalars in run]


def _fit(series):
    fitted = calibrate(series, ["pretrain-a"] * len(series), INTERVAL, DELTA, source="test")
    return fitted.table.to_dict(), fitted.log, fitted.notes


def _close(a, b) -> None:
    """Same structure, same integers and strings, floats within a relative 1e-4."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            _close(a[key], b[key])
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-9)
    else:
        assert a == b


def test_the_fit_from_tensorboard_events_is_the_fit_from_the_records(trained):
    (records,) = load_runs(str(trained / "mechmon"))
    (events,) = load_runs(str(trained / "tb"))
    assert len(records) == 80 and any("/head_" in k for k in records[-1][1])  # per-head Delta2 recorded
    # same checks, names and steps; values rounded to float32 (compared as text: a NaN equals a NaN)
    assert json.dumps(events, sort_keys=True) == json.dumps(_rounded(records), sort_keys=True)
    from_events = _fit([events])
    assert from_events == _fit([_rounded(records)])  # bit-identical on the same values
    from_records = _fit([records])
    _close(from_records[0], from_events[0])
    _close(from_records[1], from_events[1])
    assert from_events[0]["tails"] and "shewhart" in from_events[0]


def test_the_console_script_reads_each_form_of_the_run(trained, tmp_path, capsys):
    fits = {}
    for path in (trained, trained / "mechmon", trained / "mechmon" / "mechmon_scalars.jsonl", trained / "tb"):
        out = tmp_path / f"{len(fits)}.json"
        assert main([str(path), "--interval", str(INTERVAL), "--delta", str(DELTA), "--out", str(out)]) == 0, path
        assert json.loads(capsys.readouterr().out)["runs"] == 1
        fits[path] = json.loads(out.read_text())
    jsonl = [fits[p] for p in fits if p != trained / "tb"]
    assert all(f == jsonl[0] for f in jsonl)  # the same records, read from the folder, the log dir or the file
    _close(jsonl[0], fits[trained / "tb"])
