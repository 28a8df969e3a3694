"""A DeepSpeed series (the DeepSpeed GPT-MoE example, q_proj/k_proj with GQA, MoE gate) reads the
values the online DeepSpeed session wrote for the same windows, router-weight monitors included."""

from __future__ import annotations

import math

import pytest

from mechmon_megatron.scan import ScanConfig, run_scan
from mechmon_megatron.session import names
from tests.deepspeed._ds_runs import read_csv_monitor, run_example
from tests.scan.series import cached_values

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

SAVE = 10
ITERS = 40


def _csv_name(tag: str) -> str:
    return tag.replace("/", "_")  # DeepSpeed's csv_monitor file names


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_deepspeed_series_matches_the_online_session(tmp_path):
    save, monitor = tmp_path / "ds_ckpt", tmp_path / "monitor"
    run_example(["--train-iters", ITERS, "--save", save, "--save-interval", SAVE, "--monitor-dir", monitor,
                 "--mechmon-set", f"interval={SAVE}", "--mechmon-set", f"delta={SAVE}"], nproc=1).check(0)
    online = read_csv_monitor(monitor)
    summary = run_scan(ScanConfig(inputs=(str(save),), out=str(tmp_path / "scan"), num_attention_heads=4,
                                  progress=False))
    assert summary["format"] == "deepspeed" and summary["checkpoints"] == [10, 20, 30, 40]
    assert summary["router_layers"] == [1, 2] and summary["heads"]["1"] == {"num_heads": 4, "num_groups": 2,
                                                                          "head_dim": 16}
    assert summary["first_anomaly"] is None  # 3 pairs: all inside the detector's warm-up, and the notes say so
    assert any("was not judged" in note for note in summary["notes"])
    values = cached_values(tmp_path / "scan")
    compared = 0
    for layer in (1, 2):
        for tag in (names.attn("delta2_entropy", layer), names.attn("dw_entropy", layer),
                    names.attn("dwk_entropy", layer), names.router("weight_similarity", layer),
                    names.router("eps", layer)):
            for step in (20, 30, 40):
                # Same float32 parameters (the checkpoint's module state), same float64 kernels.
                want = online[_csv_name(tag)][step]
                assert math.isclose(values[(step, tag)], want, rel_tol=1e-6, abs_tol=1e-7), (tag, step)
                compared += 1
    assert compared == 30
