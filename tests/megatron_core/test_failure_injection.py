"""A monitor failure on one rank never kills or hangs a 2-rank TP=2 + SP job (issue 11).

Failures are injected on rank 1 (tests/megatron_core/_failure_driver.py) into every phase of a
check of the real example trainer. The ranks run as plain processes, as under ``srun`` without
torchrun: nothing tears the job down when one exits, so a rank left waiting in a collective
would show as a timeout (which fails the test).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.megatron_core._torchrun import REPO_ROOT, run_ranks

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.distributed

DRIVER = REPO_ROOT / "tests" / "megatron_core" / "_failure_driver.py"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-cpu-initialization", "--seed", "3",
         "--corpus-max-bytes", "100000", "--distributed-timeout-minutes", "2"]
MECHMON = ["--mechmon", "--mechmon-interval", "5", "--mechmon-delta", "5"]
TIMEOUT_S = 240  # a hang in a collective outlasts this (gloo's own timeout is 2 minutes)


def _decisions(prefix: Path, rank: int) -> list[dict]:
    path = Path(f"{prefix}.rank{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _launch(tmp_path: Path, inject: str, extra: list[str], kind: str = "error", iters: int = 30):
    decisions = tmp_path / "decisions"
    env = {"MECHMON_INJECT": inject, "MECHMON_INJECT_RANK": "1", "MECHMON_INJECT_KIND": kind,
           "MECHMON_DECISIONS": str(decisions)}
    results = run_ranks(DRIVER, [*MODEL, *MECHMON, "--train-iters", str(iters), *extra], timeout_s=TIMEOUT_S,
                        env=env)
    for rank, result in enumerate(results):
        assert not result.timed_out, f"rank {rank} hung:\n{result.output[-4000:]}"
    return results, [_decisions(decisions, r) for r in (0, 1)]


def test_failure_in_every_phase_is_counted_and_training_goes_on(tmp_path: Path):
    tb = tmp_path / "tb"
    inject = "read@5,snapshot@10,kernel@20,router@25,decision@30,write@35"
    results, (rank0, rank1) = _launch(tmp_path, inject, ["--tensorboard-dir", str(tb)], kind="oom", iters=40)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.output[-4000:]}"
    # Both ranks took the same decision at every check, and no check was lost.
    assert rank0 == rank1 and [d["iteration"] for d in rank0] == list(range(5, 41, 5))
    assert not any(d["alarm"] or d["stop"] for d in rank0)
    log1 = results[1].output
    for phase, iteration in (("read", 5), ("snapshot", 10), ("kernel", 20), ("router", 25), ("decision", 30),
                             ("write", 35)):
        assert re.search(rf"counted in mechmon/errors; training goes on\): rank 1, iteration {iteration}, "
                         rf"phase {phase}\b.*OutOfMemoryError", log1), phase
    # The peer of the failed TP gather raised too instead of waiting in the collective.
    assert re.search(r"rank 0, iteration 5, phase read, layer 1: PeerFailure", results[0].output)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    errors = {e.step: e.value for e in acc.Scalars("mechmon/errors")}
    # read@5: rank 1 + rank 0 (its peer) for each of 2 layers; snapshot@10 (taken at 10 for the
    # check at 15); kernel@20; router@25; the decision of 30 and the write of 35 are written later.
    assert errors[5] == 4 and errors[40] >= 10, errors
    assert 35 not in errors  # that write failed; the check's decision stood (no alarm either way)
    assert "mechmon/attn/delta2_entropy/layer_1" in acc.Tags()["scalars"]


@pytest.mark.parametrize("inject,kind", [("read@10", "oom"), ("router@10", "error"), ("decision@10", "error")])
def test_strict_failure_stops_every_rank_with_the_same_error(tmp_path: Path, inject: str, kind: str):
    results, (rank0, rank1) = _launch(tmp_path, inject, ["--mechmon-strict"], kind=kind, iters=30)
    phase = inject.split("@")[0]
    for rank, result in enumerate(results):
        # The uncaught MechmonStrictError: Python's exit status 1 on every rank, not a signal.
        assert result.returncode == 1, f"rank {rank} exited with {result.returncode}:\n{result.output[-3000:]}"
        assert "MechmonStrictError: mechmon monitor failed and --mechmon-strict is set; every rank stops: " \
               f"rank 1, iteration 10, phase {phase}" in result.output, result.output[-3000:]
    assert rank0[-1]["iteration"] == rank1[-1]["iteration"] == 10
    assert rank0[-1]["stop"] == rank1[-1]["stop"]


def test_writer_failure_never_loses_a_real_alarm(tmp_path: Path):
    save = tmp_path / "ckpt"
    extra = ["--mechmon-action", "checkpoint-and-abort", "--mechmon-exit-code", "42", "--save", str(save),
             "--save-interval", "5", "--tensorboard-dir", str(tmp_path / "tb")]
    # NaN in layer 1's weights after step 12: the check at 15 alarms (non-finite), not a drill.
    results, (rank0, rank1) = _launch(tmp_path, "write@*,nan@12", extra, iters=30)
    for rank, result in enumerate(results):
        assert result.returncode == 42, f"rank {rank}:\n{result.output[-4000:]}"
    assert rank0 == rank1 and rank0[-1]["iteration"] == 15 and rank0[-1]["alarm"]
    assert "nonfinite" in rank0[-1]["families"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "15"
    alert = json.loads((save / "iter_0000015" / "mechmon_alert.json").read_text())
    assert alert["family"] == "nonfinite" and alert["exit_code"] == 42
    assert "phase write" in results[1].output
