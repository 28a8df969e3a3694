"""Gradient accumulation on a real DeepSpeed engine: a check step's router statistics are the sum
over all its micro-batches, not the last one (engine.step() runs after every micro-batch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.deepspeed._ds_runs import ENV, MODEL
from tests.megatron_core._torchrun import REPO_ROOT, run_ranks

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

DRIVER = REPO_ROOT / "tests" / "deepspeed" / "_ga_driver.py"
ACCUMULATION = 4
EXPERTS, BINS = 4, 512  # MODEL's --num-experts; the default --mechmon-router-entropy-bins


def test_accumulation_4_counts_every_micro_batch_of_a_check_step(tmp_path: Path):
    out, logs = tmp_path / "record.json", tmp_path / "logs"
    # global batch 4 on one rank with micro-batch 1: four micro-batches per optimizer step.
    args = [*MODEL, "--micro-batch-size", "1", "--train-iters", "4", "--mechmon-set", "interval=2",
            "--mechmon-set", "delta=2", "--mechmon-set", 'monitors=["router"]', "--mechmon-set", f'log_dir="{logs}"']
    (result,) = run_ranks(DRIVER, [out, *args], nproc=1, timeout_s=150, env=ENV)
    result.check(0)
    record = json.loads(out.read_text())
    reference, reduced = record["reference"], record["reduced"]
    assert sorted(reduced) == ["2/1", "2/2", "4/1", "4/2"], sorted(reduced)
    tokens_per_micro_batch = 32  # --seq-length 32, micro-batch 1
    for key, vector in reduced.items():
        want = reference[key]
        assert want["micro_batches"] == ACCUMULATION, (key, want)
        assert want["tokens"] == ACCUMULATION * tokens_per_micro_batch
        # flat summary: tokens, non-finite, entropy sum, histogram, expert counts, failure mark
        tokens, nonfinite, entropy_sum = vector[:3]
        counts = vector[3 + BINS:3 + BINS + EXPERTS]
        assert (tokens, nonfinite, vector[-1]) == (want["tokens"], 0.0, 0.0), key
        assert math.isclose(entropy_sum, want["entropy_sum"], rel_tol=1e-5), (key, entropy_sum, want["entropy_sum"])
        assert counts == want["counts"], key
        assert sum(vector[3:3 + BINS]) == want["tokens"]  # every token in the entropy histogram once

    checks = [json.loads(line) for line in (logs / "mechmon_scalars.jsonl").read_text().splitlines()]
    assert [c["step"] for c in checks] == [2, 4]
    for check in checks:
        for layer in (1, 2):
            want = reference[f"{check['step']}/{layer}"]
            mean = check["scalars"][f"mechmon/router/token_entropy/layer_{layer}"]
            assert math.isclose(mean, want["entropy_sum"] / want["tokens"], rel_tol=1e-5), (check["step"], layer)
