"""One tiny fault study through the real example trainer: two short runs, results.json keys."""

import json
import os
import subprocess

import pytest

from mechmon_megatron.research.study.runner import trainer_command
from mechmon_megatron.research.study.scenarios import get_preset, with_overrides
from mechmon_megatron.research.study.study import StudyOptions, run_study

_NEEDED_FLAGS = ("--mechmon-per-head-scalars", "--fa-fault-strength", "--log-max-attention-logit", "--metrics-jsonl")

_TINY_MODEL = (
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
    "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
    "--lr-warmup-iters", "5", "--attention-backend", "emulated-lowp-fa", "--corpus-max-bytes", "200000",
)


def _trainer_help() -> str:
    proc = subprocess.run(
        [*trainer_command(), "--help"],
        capture_output=True, text=True, timeout=120,
    )
    return proc.stdout


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_tiny_study_through_the_example_trainer(tmp_path):
    help_text = _trainer_help()
    missing = [f for f in _NEEDED_FLAGS if f not in help_text]
    if missing:
        pytest.skip(f"the example trainer does not have the fault-study flags {missing} yet")
    preset = with_overrides(
        get_preset("demo"), model_flags=_TINY_MODEL, fa_onset=20, mechmon_interval=5, mechmon_delta=10,
        scenarios=("clean", "fa"),
    )
    out = str(tmp_path / "study")
    results = run_study(
        StudyOptions(out_dir=out, preset=preset, scenarios=("clean", "fa"), seeds=(1,), train_iters=40,
                     jobs=2, progress=False, plots=True)
    )
    with open(os.path.join(out, "results.json")) as f:
        saved = json.load(f)
    assert saved["runs"] and [r["scenario"] for r in saved["runs"]] == ["clean", "fa"]
    for run in saved["runs"]:
        assert run["returncode"] == 0, run.get("error_tail")
        assert run["train_iters"] == 40 and run["steps_recorded"] == 40
        assert set(run["first_alarm"]) >= {"attn_delta2", "attn_dw", "router_entropy", "router_weights",
                                           "loss_6sigma", "loss_10x", "loss_2x_mean", "grad_norm_6sigma",
                                           "max_attn_logit", "wq_spectral_norm"}
        assert run["num_checks"] == 8
    assert saved["runs"][1]["fault_onset"] == 20 and saved["runs"][0]["fault_onset"] is None
    assert os.path.isdir(os.path.join(out, "runs", "fa-seed1", "tensorboard"))
    assert len(results["study"]["plots"]) == 2
