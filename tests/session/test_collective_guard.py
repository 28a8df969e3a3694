"""The collective guard on real gloo process groups: a collective that raises at the call
on one rank costs its peers at most --mechmon-collective-timeout, after which no rank issues another
and every rank agrees that the monitors' collectives are off; the byte counter against a hand
count; a start-up refusal on one rank stops every rank with the same message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.megatron_core._torchrun import REPO_ROOT, run_ranks

pytestmark = pytest.mark.distributed

WORKER = REPO_ROOT / "tests" / "session" / "_guard_worker.py"
TIMEOUT_S = 2.0  # the worker's --mechmon-collective-timeout


MODES = ("count", "startup", "placement", "raise")  # one launch of two ranks; "raise" leaves the groups down: last


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("guard") / "guard"
    results = run_ranks(WORKER, [",".join(MODES), str(out)], nproc=2, timeout_s=120)
    for rank, result in enumerate(results):
        assert not result.timed_out and result.returncode == 0, f"rank {rank}:\n{result.output[-3000:]}"
    return {mode: [json.loads(Path(f"{out}.{mode}.rank{rank}.json").read_text()) for rank in range(2)]
            for mode in MODES}


def test_a_collective_that_raises_on_one_rank_costs_the_peer_one_timeout(rows):
    rank0, rank1 = rows["raise"]
    assert "injected transport error at the call" in rank1["error"] and rank1["seconds"] < TIMEOUT_S
    # Rank 0 was left inside the all-gather: it gave up within the timeout (not the host's 60 s).
    # It can end sooner: on an idle machine gloo sees the peer's pair close (0.6 s measured), under
    # load it waits out the 2 s; both are bounded, which is the property.
    assert "failed or timed out (--mechmon-collective-timeout 2 s)" in rank0["error"]
    assert rank0["seconds"] < TIMEOUT_S + 10, rank0
    for row in (rank0, rank1):
        assert row["later"] == "skipped" and row["up"] is False and row["down"]


def test_the_byte_counter_matches_a_hand_count(rows):
    for rank, row in enumerate(rows["count"]):
        assert row["parts"] == [[float(r)] * 3 for r in range(2)]
        # all-reduce of 5 float32: 20 bytes in, 20 out; all-gather of 3 float64: 24 out, 24 in.
        assert (row["reduce"]["sent_bytes"], row["reduce"]["received_bytes"]) == (20, 20)
        assert (row["gather"]["sent_bytes"], row["gather"]["received_bytes"]) == (24, 24)
        # broadcast of one int64 from rank 1: it sends 8 bytes, rank 0 receives 8.
        expected = (8, 0) if rank == 1 else (0, 8)
        assert (row["broadcast"]["sent_bytes"], row["broadcast"]["received_bytes"]) == expected
        assert row["flag"] == 1 and row["reduce"]["calls"] == 1


def test_the_snapshot_placement_is_one_decision_for_the_job(rows):
    """Only rank 1's budget makes ``auto`` pick pinned host memory: every rank then uses it (the
    most conservative proposal, in the start-up's one all-reduce)."""
    rank0, rank1 = rows["placement"]
    assert (rank0["own"], rank1["own"]) == ("device", "pinned")
    assert rank0["placement"] == rank1["placement"] == "pinned"


def test_a_rank_that_cannot_hold_its_snapshots_stops_every_rank_with_one_message(rows):
    rank0, rank1 = rows["startup"]
    assert rank0["error"] is not None and rank0["error"] == rank1["error"]
    message = rank0["error"]
    assert message.startswith("mechmon cannot start on every rank: rank 1: mechmon snapshots would hold")
    assert "the limit is crossed at layer 1" in message and "--mechmon-delta" in message
    assert "this rank's share of host memory" in message and "--mechmon-snapshot-device" in message


@pytest.fixture(scope="module")
def tiers(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tiers") / "guard"
    results = run_ranks(WORKER, ["tiers", str(out)], nproc=4, timeout_s=180)
    for rank, result in enumerate(results):
        assert not result.timed_out and result.returncode == 0, f"rank {rank}:\n{result.output[-3000:]}"
    return [json.loads(Path(f"{out}.tiers.rank{rank}.json").read_text()) for rank in range(4)]


def test_records_through_the_owners_decode_to_the_records_sent_straight_to_the_writer(tiers):
    """Two levels (TP pairs {0, 1} and {2, 3}, writer 3, rank 2 reports nothing): the owner of
    {0, 1} is its lowest rank, the writer owns its own pair; the writer's decoded payloads equal
    the one-level path's and the payloads sent, at the first check (schemas), a healthy one and
    one with objects at the first level only (rank 1's non-finite report and limit reason)."""
    assert [row["leader"] for row in tiers] == [0, 0, -1, 3] and tiers[3]["leaders"] == [0, 3]
    assert tiers[0]["part"] == [0, 1] and tiers[3]["part"] == [3]
    writer = tiers[3]["checks"]
    assert len(writer) == 3
    for check in writer:
        assert check["tiered"] == check["direct"] == check["expected"]
    assert "inf in W_q" in writer[2]["tiered"][1] and "below the entropy floor" in writer[2]["tiered"][1]
    for rank in (0, 1):
        assert all(c["tiered"] is None and c["direct"] is None for c in tiers[rank]["checks"])
    # Steady state (check 1): the writer receives one row from one peer (the owner of {0, 1}) instead
    # of two; rank 1 sends its row to rank 0 only.
    steady = writer[1]
    assert steady["one_level"]["messages"] == 2 and steady["two_level"]["messages"] == 1
    assert tiers[1]["checks"][1]["two_level"]["messages"] == 0
    assert tiers[0]["checks"][1]["two_level"]["messages"] == 1  # rank 1's row at its owner


def test_a_gather_that_raises_at_the_first_level_ends_on_every_rank_in_bounded_time(tiers):
    raised = [row["raise"] for row in tiers]
    assert "injected transport error at the call" in raised[1]["error"]
    # Rank 0 (the owner) waited for rank 1 at the first level, the writer for rank 0 at the second.
    for rank in (0, 3):
        assert "failed or timed out (--mechmon-collective-timeout 2 s)" in raised[rank]["error"], raised[rank]
    for rank, row in enumerate(raised):
        assert row["up"] is False and row["down"], (rank, row)
        # A level, then the whole-job agreement: at most about two timeouts (plus a loaded machine).
        assert row["seconds"] < 2 * TIMEOUT_S + 10, (rank, row)
