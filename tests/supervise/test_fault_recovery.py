"""The loop recovers real fault runs of the example trainer: a real detector alarm (no drill).

The fault study's model (4 layers, hidden 128, 8 experts top-2, the emulated BF16 flash
attention; research/study/scenarios.py) at the study's monitor schedule (checks every 20 steps
over a 100-step window, the shipped calibration, the default false-alarm rate), with one fault:

- FA: the amplified biased rounding of O in the FA backward (32 BF16 ulps, all rows) from step
  400; the Delta2 / dW CUSUM alarms; the default policy leaves the emulated kernel (the injected
  rounding lives in it) for PyTorch's FP32 attention.
- LR: the whole-model 4x learning rate (8e-3) from step 1, 2 ranks with TP=2 under torchrun;
  the routing-entropy detector alarms at 180; the default policy halves --lr and --min-lr from
  iter_0000100, which alarms again at 180 (the router of layer 1 was already driven towards the
  floor in the 4x warm-up); the next remedy halves them again, and since the rollback point
  alarmed again the rollback goes further back: to the command's start, as no save is older.

Each test checks: the alarm is the detector's (its family, not "drill"), the rollback checkpoint
is at or before the alert's change point, the remedy's flags are in the relaunched command read
back from mechmon_recovery.jsonl, and the relaunch trains to --train-iters with no second alarm.
Slow (minutes on 2 cores): MECHMON_SLOW=1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mechmon_megatron.supervise.command import flag_values, parse_command
from tests.megatron_core._torchrun import free_port
from tests.supervise._helpers import records, supervise

pytest.importorskip("megatron.core")

STUDY_MODEL = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--ffn-hidden-size", "256", "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
    "--lr-warmup-iters", "100", "--attention-backend", "emulated-lowp-fa", "--micro-batch-size", "4",
    "--global-batch-size", "4", "--lr-decay-iters", "1500", "--log-interval", "100", "--num-threads", "1",
    "--seed", "1",
]
MONITOR = ["--mechmon", "--mechmon-interval", "20", "--mechmon-delta", "100", "--mechmon-action",
           "checkpoint-and-abort", "--mechmon-full-matrix-method", "exact", "--mechmon-wq-norm-power-iters", "0"]
TRAINER = [sys.executable, "-m", "gpt_trainer"]


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_recovery(save: Path, out, family_prefix: str, train_iters: int, metrics: Path,
                    restarts: int = 1) -> list[dict]:
    assert out.returncode == 0, out.output[-5000:]
    recs = records(save)
    assert [r["action"] for r in recs] == ["relaunch"] * restarts + ["stop"], recs
    *relaunches, done = recs
    for relaunch in relaunches:
        alert = relaunch["alert"]
        assert alert["family"].startswith(family_prefix) and alert["family"] != "drill", alert
        assert relaunch["checkpoint"]["iteration"] <= alert["first_warning_step"] < alert["iteration"], relaunch
        assert relaunch["after_change_point"] is False
    assert done["exit_code"] == 0 and "--mechmon-drill-at" not in " ".join(relaunches[-1]["command"])
    # the last relaunch trained to the end without an alarm (an alarm aborts: another record); the
    # trainer's abort lines ("exiting at iteration N: [mechmon] ALARM ...", rank 0): one per relaunch
    assert out.output.count("exiting at iteration") == restarts, out.output[-4000:]
    rows = _metrics(metrics)
    assert max(int(r["iteration"]) for r in rows) == train_iters
    assert (save / f"iter_{train_iters:07d}").is_dir()
    return relaunches


@pytest.mark.slow
def test_fa_fault_run_is_recovered_by_leaving_the_faulty_kernel(tmp_path: Path):
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    fault = ["--fa-fault-strength", "32", "--fa-fault-onset", "400", "--fa-fault-mode", "all_rows"]
    command = [*TRAINER, *STUDY_MODEL, "--lr", "0.002", "--min-lr", "0.0002", *MONITOR, *fault,
               "--train-iters", "800", "--save", str(save), "--save-interval", "100",
               "--metrics-jsonl", str(metrics), "--log-max-attention-logit"]
    out = supervise([], command, timeout_s=1800)
    (relaunch,) = _check_recovery(save, out, "attn_", 800, metrics)
    assert relaunch["alert"]["iteration"] > 400 and relaunch["alert"]["first_warning_step"] >= 300
    assert relaunch["remedy"] == "fp32-attention-output"
    host = parse_command(relaunch["command"]).host_args
    assert flag_values(host, "--attention-backend") == ["torch"]
    assert flag_values(host, "--fa-fault-strength") is None and flag_values(host, "--fa-fault-onset") is None
    assert flag_values(host, "--ckpt-step") == [str(relaunch["checkpoint"]["iteration"])]
    assert "--fa-fault-strength 32" in relaunch["flags_removed"]


@pytest.mark.slow
@pytest.mark.distributed
def test_lr_fault_run_with_tp2_is_recovered_from_the_start_at_half_the_lr(tmp_path: Path):
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(free_port()), "-m", "gpt_trainer"]
    command = [*launcher, *STUDY_MODEL, "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--lr", "0.008", "--min-lr", "0.0008", *MONITOR, "--train-iters", "500", "--save", str(save),
               "--save-interval", "100", "--metrics-jsonl", str(metrics)]
    out = supervise([], command, timeout_s=2400)
    (first,) = _check_recovery(save, out, "router_", 500, metrics)
    assert first["exit_code"] == 1  # torchrun's code for a worker's 42
    # The routing-entropy floor fires in the detector's warm-up: no baseline ever existed, so the
    # change point is the first check's window start (0), and the rollback is the command's own
    # start (the 4x LR drove the router to the floor within the first save interval; from
    # iter_0000100 even half the LR collapsed again), with the LR halved.
    assert first["alert"]["first_warning_step"] == 0 and first["remedy"] == "lower-lr"
    assert first["checkpoint"]["name"] == "start" and "the command's own start" in first["why"]
    host = parse_command(first["command"]).host_args
    assert float(flag_values(host, "--lr")[0]) == pytest.approx(0.004)
    assert float(flag_values(host, "--min-lr")[0]) == pytest.approx(0.0004)
    assert flag_values(host, "--load") is None and flag_values(host, "--ckpt-step") is None
    assert first["command"][:len(launcher)] == launcher
