"""Offline == online: replaying a real run's recorded scalars reproduces the session's detector
statistics and alarms exactly (same inputs, same code, same thresholds)."""

import os
import subprocess

import pytest

from mechmon_megatron.detect.null_model import load_tail_table
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.study.analysis import read_jsonl
from mechmon_megatron.research.study.pooled_replay import replay_pooled, thresholds_at_rate
from mechmon_megatron.research.study.runner import trainer_command
from mechmon_megatron.session import names

RATE = 1000.0  # sensitive, so that the short run also exercises alarms and restarts


@pytest.mark.distributed
def test_replay_reproduces_the_online_detector(tmp_path):
    log_dir = tmp_path / "mechmon"
    cmd = [
        *trainer_command(),
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
        "--lr", "3e-3", "--lr-warmup-iters", "5", "--attention-backend", "emulated-lowp-fa",
        "--corpus-max-bytes", "200000", "--micro-batch-size", "2", "--train-iters", "300", "--seed", "3",
        "--fa-fault-strength", "64", "--fa-fault-onset", "220", "--fa-fault-mode", "all_rows",
        "--num-threads", "1", "--log-interval", "1000",
        "--mechmon", "--mechmon-interval", "10", "--mechmon-delta", "10", "--mechmon-action", "log",
        "--mechmon-per-head-scalars", "--mechmon-false-alarm-rate", str(RATE), "--mechmon-log-dir", str(log_dir),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_jsonl(str(log_dir / "mechmon_scalars.jsonl"))
    checks = [(int(r["step"]), {k: float("nan") if v is None else v for k, v in r["scalars"].items()}) for r in rows]
    assert len(checks) == 30
    thresholds, _ = thresholds_at_rate(checks, 10, 1, RATE, load_tail_table())
    detector_statistics = 0
    replay = replay_pooled(checks, thresholds, default_sequential_config(10))
    for step, scalars in checks:
        online = {k[len(names.DETECT_PREFIX) + 1:]: v for k, v in scalars.items() if k.startswith(names.DETECT_PREFIX)}
        for key, series in replay.statistics.items():
            values = dict(series)
            if step in values:
                assert online[key] == values[step], (step, key)
                detector_statistics += 1
    assert detector_statistics > 100
    online_alarms = [s for s, sc in checks if sc[names.ALARM] == 1.0]
    assert sorted({a.step for a in replay.alarms}) == online_alarms
    assert "detector: 12 tests" in proc.stderr + proc.stdout  # 4 families x (2 layers + the family test)
