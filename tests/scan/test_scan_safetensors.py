"""Hugging Face safetensors folders (the healthy trainer checkpoints exported with q_proj/k_proj and
with a fused qkv_proj) read the same values as the torch_dist checkpoints they came from."""

from __future__ import annotations

import math

import pytest

from mechmon_megatron.scan import ScanConfig, run_scan
from tests.scan import series as S

pytest.importorskip("megatron.core")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.distributed

ITERATIONS = [380, 400, 420]



@pytest.mark.parametrize("fused", [False, True], ids=["q_proj_k_proj", "fused_qkv_proj"])
def test_safetensors_series_reads_the_trainer_values(healthy, tmp_path, fused):
    run_dir = tmp_path / "hf_run"
    for iteration in ITERATIONS:
        S.export_hf(healthy.save / f"iter_{iteration:07d}", run_dir / f"checkpoint-{iteration}", fused=fused)
    # Heads from config.json: no flag needed.
    summary = run_scan(ScanConfig(inputs=(str(run_dir),), out=str(tmp_path / "scan"), progress=False))
    assert summary["format"] == "hf_safetensors" and summary["checkpoints"] == ITERATIONS
    assert summary["pairs"] == 2 and summary["first_anomaly"] is None
    run_scan(ScanConfig(inputs=S.checkpoint_dirs(healthy.save, ITERATIONS), out=str(tmp_path / "ref"),
                        num_attention_heads=S.HEADS, progress=False))
    got, want = S.cached_values(tmp_path / "scan"), S.cached_values(tmp_path / "ref")
    # Same float32 weights, rows only re-ordered into heads by another layout: same values to round-off.
    assert set(got) == set(want) and len(want) > 30
    assert all(math.isclose(got[k], v, rel_tol=1e-12, abs_tol=1e-12) for k, v in want.items())
