"""``tools/deepspeed_lr_study.py`` end to end on two short DeepSpeed runs (CPU, gloo)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.megatron_core._torchrun import REPO_ROOT

TOOL = REPO_ROOT / "tools" / "deepspeed_lr_study.py"


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_lr_study_trains_analyses_and_replays_the_online_alarms(tmp_path):
    out = tmp_path / "study"
    small = "--num-layers 2 --hidden-size 64 --seq-length 32 --corpus-max-bytes 100000 --log-interval 1000"
    cmd = [sys.executable, str(TOOL), "--lrs", "2e-3,1e-1", "--seeds", "4", "--train-iters", "40",
           "--interval", "5", "--delta", "5", "--jobs", "2", "--out", str(out), "--extra", small,
           "--no-progress", "--json"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout)
    assert [(r["run"], r["fault"]) for r in runs] == [("lr0.002-seed4", False), ("lr0.1-seed4", True)]
    saved = json.loads((out / "results.json").read_text())["runs"]
    assert saved == runs and (out / "effective_experts.png").stat().st_size > 0
    for r in runs:
        assert (r["steps_recorded"], r["num_checks"]) == (40, 8)
        assert 1.0 <= r["effective_experts_min"] <= 8.0 and 0.0 <= r["norm_entropy_min"] <= 1.0
        # The replay with the session's default detector reproduces what the run raised online.
        replayed = [s for s in r["first_alarm"].values() if s is not None]
        assert r["online_first_alarm"] == (min(replayed) if replayed else None)
    # --analyze-only re-reads the same files and gives the same answer.
    again = subprocess.run(
        [*cmd[:2], "--lrs", "2e-3,1e-1", "--seeds", "4", "--out", str(out), "--analyze-only", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and json.loads(again.stdout) == runs
