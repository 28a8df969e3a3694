"""The check records through the tensor-parallel owners decode on the writer exactly as when every
reporting rank sends straight to it: a real 4-rank gloo job of the example trainer,
TP 2 x DP 2 with sequence parallelism, a check at every step (schemas at the first, then rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.megatron_core._torchrun import REPO_ROOT, run_ranks

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.distributed

DRIVER = REPO_ROOT / "tests" / "megatron_core" / "_records_parity_driver.py"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-cpu-initialization", "--seed", "3",
         "--corpus-max-bytes", "20000", "--distributed-timeout-minutes", "4"]
MECHMON = ["--mechmon", "--mechmon-interval", "1", "--mechmon-delta", "1", "--mechmon-action", "log",
           "--mechmon-per-head-scalars"]


@pytest.mark.slow  # fast leg budget: four trainer ranks, ~100 s on the loaded 2-core machine; the
# two-level path and its failure stay fast in tests/session/test_collective_guard.py (4 gloo ranks)
def test_two_level_records_equal_one_level_on_a_tp2_dp2_sp_job(tmp_path: Path):
    out = tmp_path / "parity"
    results = run_ranks(DRIVER, [*MODEL, *MECHMON, "--train-iters", "4"], nproc=4, timeout_s=420,
                        env={"MECHMON_PARITY_OUT": str(out)})
    for rank, result in enumerate(results):  # every rank's own exit code
        assert not result.timed_out and result.returncode == 0, f"rank {rank}:\n{result.output[-4000:]}"
    rows = [json.loads(line) for line in Path(f"{out}.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # a check at every step
    for row in rows:
        assert row["two_level"] is True
        assert row["tiered"] == row["direct"] and len(row["tiered"]) == len(row["reporting"])
        assert any("delta2_entropy" in p for p in row["tiered"]) and any("router" in p for p in row["tiered"])
    # Ranks (dp, tp) = global 2 dp + tp; writer 3. Layer 1's per-head work on replica 0 (ranks 0, 1),
    # layer 2's on replica 1 (ranks 2, 3); the routers on rank 0. Owners: 0 for {0, 1}, the writer
    # for {2, 3}: the writer hears from one peer of its own group and one owner (one level: three).
    assert rows[-1]["reporting"] == [0, 1, 2, 3] and rows[-1]["owners"] == [0, 3]
    assert rows[-1]["tiered_messages"] == 2 and rows[-1]["direct_messages"] == 3
