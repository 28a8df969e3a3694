"""A monitor failure on one rank never kills or hangs a 2-rank TP=2 + SP job.

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


def _decisions(prefix: Path, rank: int, times: bool = False) -> list[dict]:
    """Rank ``rank``'s decision rows (without their wall times unless ``times``)."""
    path = Path(f"{prefix}.rank{rank}.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not times:
        for row in rows:
            row.pop("time", None)
    return rows


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


# Two of the three strict cases are slow (fast leg budget); decision@10 runs in the fast leg.
@pytest.mark.parametrize("inject,kind", [pytest.param("read@10", "oom", marks=pytest.mark.slow),
                                         pytest.param("router@10", "error", marks=pytest.mark.slow),
                                         ("decision@10", "error")])
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


COLLECTIVE_TIMEOUT_S = 15
"""--mechmon-collective-timeout of the tests below: the peer waits this long, then gives up (longer
than the writer's decision may take on a loaded 2-core machine, where the peers wait for it)."""

MARGIN_S = 40
"""What a rank may take beyond the collective timeout to notice, agree and stop (a loaded machine)."""


@pytest.mark.parametrize("strict", [pytest.param(False, marks=pytest.mark.slow), True], ids=["non-strict", "strict"])
def test_a_collective_that_raises_on_one_rank_ends_in_bounded_time_on_every_rank(tmp_path: Path, strict: bool):
    """torch.distributed.all_gather raises at the call on rank 1 (the tensor-parallel gather of
    the check at 5): rank 0 is left inside the collective, on mechmon's own group, and gives up
    after --mechmon-collective-timeout; then both turn the monitors off and train to the end
    (exit 0), or under --mechmon-strict both stop with the same message (exit 1, Python's status
    for the uncaught MechmonStrictError); rank 0 never waits until it is killed.
    The non-strict case waits the whole timeout (68 s on the loaded 2-core machine): slow leg;
    tests/session/test_collective_guard.py covers the timeout itself in the fast leg."""
    extra = ["--mechmon-collective-timeout", str(COLLECTIVE_TIMEOUT_S), *(["--mechmon-strict"] if strict else [])]
    results, _ = _launch(tmp_path, "collective@5", extra, iters=15)
    decisions = tmp_path / "decisions"
    inject = json.loads(Path(f"{decisions}.inject.json").read_text())
    assert inject["rank"] == 1 and inject["iteration"] == 5
    rows = [_decisions(decisions, r, times=True) for r in (0, 1)]
    for rank, result in enumerate(results):
        assert result.returncode == (1 if strict else 0), f"rank {rank}:\n{result.output[-4000:]}"
        # Each rank's own decision at the check of the failure: the monitors are off there.
        at5 = [row for row in rows[rank] if row["iteration"] == 5]
        assert at5 and at5[0]["off"], rows[rank]
        assert at5[0]["time"] - inject["time"] <= COLLECTIVE_TIMEOUT_S + MARGIN_S, (rank, at5, inject)
    if strict:
        message = ("MechmonStrictError: mechmon monitor failed and --mechmon-strict is set; every rank stops: a "
                   f"monitor collective failed or timed out at iteration 5 (--mechmon-collective-timeout "
                   f"{COLLECTIVE_TIMEOUT_S} s)")
        for rank, result in enumerate(results):
            assert message in result.output, f"rank {rank}:\n{result.output[-3000:]}"
        assert [r["iteration"] for r in rows[0]] == [r["iteration"] for r in rows[1]] == [5]
    else:
        for rank, result in enumerate(results):
            assert "the monitors are off on every rank from now on" in result.output, result.output[-3000:]
            # Training went on to the end; the later checks ran no monitor (off on both ranks).
            assert [r["iteration"] for r in rows[rank]] == [5, 10, 15] and all(r["off"] for r in rows[rank])
        # Rank 0 waited in the collective: its own failure names the timeout; rank 1's, the raise.
        assert f"failed or timed out (--mechmon-collective-timeout {COLLECTIVE_TIMEOUT_S} s)" in results[0].output
        assert "injected failure in collective" in results[1].output
