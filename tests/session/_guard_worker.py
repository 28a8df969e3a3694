"""One rank of the collective-guard tests (tests/session/test_collective_guard.py), real gloo.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python tests/session/_guard_worker.py MODES OUT

``MODES``: a comma-separated list, run in order in one process (each rank writes
``OUT.<mode>.rank<r>.json``); ``raise`` leaves mechmon's groups down, so it comes last:

* ``raise``: mechmon's all-gather raises at the call on rank 1 (``torch.distributed.all_gather``
  patched there only); every rank records how long it took and what the end-of-step agreement said;
* ``count``: one all-gather, one all-reduce, one object gather and broadcast; the byte counter;
* ``startup``: a session whose rank 1 has a host-memory share too small for its snapshots
  (``LOCAL_WORLD_SIZE`` huge there): every rank records the error it raised;
* ``placement``: a session whose rank 1 only has a host-memory share that makes ``auto`` pick
  ``pinned`` (the other rank's would pick ``device``): every rank records the placement it uses;
* ``tiers`` (4 ranks, tensor-parallel pairs {0, 1} and {2, 3}, writer 3; rank 2 does not report):
  three checks of records through the owners and straight to the writer, every rank's decoded
  payloads and byte counts, then a gather that raises at the call on rank 1 (the first level:
  rank 1 to its owner 0); every rank records how long it took and the end-of-step agreement.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from mechmon_megatron.session import collective_guard
from mechmon_megatron.session.collective_guard import CollectiveFailure, CollectivesOff
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import (
    REPORTING,
    AttentionSite,
    QKWeights,
    SnapshotBudget,
    TorchDistributedCommunicator,
)
from mechmon_megatron.session.records import NonFinite, Partial, Payload, Stream
from mechmon_megatron.session.session import MonitoringSession

TIMEOUT_S = 2.0


def _raise(rank: int) -> dict:
    guard = collective_guard.reset_guard(TIMEOUT_S)
    guard.create_declared()
    if rank == 1:
        def failing(*args, **kwargs):
            raise RuntimeError("injected transport error at the call")

        dist.all_gather = failing
    start = time.perf_counter()
    parts = [torch.empty(4) for _ in range(dist.get_world_size())]
    error = ""
    try:
        guard.all_gather(parts, torch.full((4,), float(rank)), None, "a test gather")
    except CollectiveFailure as exc:
        error = str(exc)
    try:
        guard.all_reduce(torch.ones(1), None, "a later all-reduce")
        later = "ran"
    except CollectivesOff:
        later = "skipped"
    up = guard.agree_up()
    return {"error": error, "later": later, "up": up, "seconds": time.perf_counter() - start, "down": guard.down}


def _count(rank: int) -> dict:
    guard = collective_guard.reset_guard(60.0)  # healthy collectives: no timeout on a loaded machine
    guard.create_declared()
    world = dist.get_world_size()
    parts = [torch.empty(3, dtype=torch.float64) for _ in range(world)]
    guard.all_gather(parts, torch.full((3,), float(rank), dtype=torch.float64), None, "gather")
    guard.counter.take()
    guard.all_reduce(torch.ones(5, dtype=torch.float32), None, "reduce")
    reduce = guard.counter.take()
    guard.all_gather(parts, torch.full((3,), float(rank), dtype=torch.float64), None, "gather")
    gather = guard.counter.take()
    flag = guard.broadcast(torch.tensor([rank], dtype=torch.int64), world - 1, None, "broadcast")
    broadcast = guard.counter.take()
    return {"reduce": reduce, "gather": gather, "broadcast": broadcast, "flag": int(flag.item()),
            "parts": [p.tolist() for p in parts]}


def _startup(rank: int) -> dict:
    collective_guard.reset_guard(60.0)
    if rank == 1:
        os.environ["LOCAL_WORLD_SIZE"] = str(10**12)  # a share of host memory below one snapshot
    try:
        return _start_session()
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


def _placement(rank: int) -> dict:
    """``auto`` on a (stand-in) 1 GiB accelerator with ``snapshot_max_device_share`` 0.01: rank 1's
    snapshots (one layer of 16 MiB) exceed its 10 MiB share and pick ``pinned``, rank 0's (1 MiB)
    ``device``. No GPU here: the accelerator's capacity query is the one stand-in."""
    from mechmon_megatron.session import snapshots

    collective_guard.reset_guard(60.0)
    snapshots.device_memory_bytes = lambda device: 2**30  # the GPU's capacity, the only stand-in
    elements = (16 if rank == 1 else 1) * 2**20 // 4
    budget = SnapshotBudget(heads_elements=elements, full_elements=0, shared=False, element_size=4,
                            device=torch.device("cuda", 0))
    site = AttentionSite(1, read_heads=lambda: None, read_full=lambda: None, snapshot_budget=budget)
    config = MechmonConfig(enabled=True, interval=5, delta=5, full_matrix_dw=False, snapshot_max_device_share=0.01)
    own = snapshots.choose_placement(config, budget.nbytes(False), budget.device)
    session = MonitoringSession(config, [site], comm=TorchDistributedCommunicator())
    return {"own": own, "placement": session.snapshots.placement}


def _start_session() -> dict:
    wq, wk = torch.zeros(4, 8, 16), torch.zeros(2, 8, 16)
    sites = []
    for layer in (1, 2):
        budget = SnapshotBudget(heads_elements=wq.numel() + wk.numel(), full_elements=0, shared=False,
                                element_size=4, device=torch.device("cpu"))
        sites.append(AttentionSite(layer, read_heads=lambda: QKWeights(wq, wk), read_full=lambda: None,
                                   snapshot_budget=budget))
    config = MechmonConfig(enabled=True, interval=5, delta=5, full_matrix_dw=False)
    try:
        MonitoringSession(config, sites, comm=TorchDistributedCommunicator())
        return {"error": None}
    except ValueError as exc:
        return {"error": str(exc)}


def _payload(rank: int, check: int) -> Payload:
    """A reporting rank's records at check ``check``: rank-dependent sizes, a limit, and at the
    third check a non-finite report and a stream beyond its limit on rank 1 (objects at level 1)."""
    streams = [Stream(name=f"mechmon/attn/delta2_entropy/layer_{rank}/head_{h}", family="attn_delta2",
                      value=0.1 * rank + h + check / 7, layer_number=rank + 1, member=f"head_{h}", head=h)
               for h in range(rank + 1)]
    alarm = check == 2 and rank == 1
    streams.append(Stream(name=f"mechmon/router/token_entropy/layer_{rank}", family="router_entropy",
                          value=0.5 if alarm else 2.0 + rank, layer_number=rank + 1, limit=1.0,
                          limit_reason="below the entropy floor" if alarm else ""))
    scalars = [{f"mechmon/attn/x/layer_{rank}": Partial("mean", 1.5 * rank + check, 2.0),
                "mechmon/attn/m": Partial("min", -float(rank) / 3)}]
    nonfinite = [NonFinite(rank + 1, "inf in W_q")] if alarm else []
    return Payload(rank=rank, layers={"attn_delta2": [rank + 1]}, scalars=scalars, streams=streams,
                   nonfinite=nonfinite, overhead_s=0.001 * (rank + 1) * (check + 1))


def _tiers(rank: int) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # the host's tensor-parallel groups
    tp = pairs[rank // 2]
    reports = rank != 2
    guard = collective_guard.reset_guard(60.0)  # healthy collectives: no timeout on a loaded machine
    comm = TorchDistributedCommunicator(owner_group=tp)
    comm.set_reporting(reports)
    guard.create_declared()
    tiers = guard.tiers(REPORTING)
    row: dict = {"leaders": list(tiers.leaders.ranks), "part": list(tiers.part.ranks), "leader": tiers.leader,
                 "checks": []}
    for check in range(3):
        if not reports:
            continue
        payload = _payload(rank, check)
        guard.counter.take()
        direct = comm.gather_direct(payload)
        one = guard.counter.take()
        tiered = comm.gather_tiered(payload)
        two = guard.counter.take()
        row["checks"].append({"direct": None if direct is None else [repr(p) for p in direct],
                              "tiered": None if tiered is None else [repr(p) for p in tiered],
                              "expected": [repr(_payload(r, check)) for r in (0, 1, 3)],
                              "one_level": one, "two_level": two})
    # The first level raises at the call on rank 1 (dist.gather, rank 1 to its owner 0).
    guard = collective_guard.reset_guard(TIMEOUT_S)
    comm = TorchDistributedCommunicator(owner_group=tp)
    comm.set_reporting(reports)
    guard.create_declared()
    if rank == 1:
        def failing(*args, **kwargs):
            raise RuntimeError("injected transport error at the call")

        dist.gather = failing
    start = time.perf_counter()
    error = ""
    if reports:
        try:
            comm.gather_tiered(_payload(rank, 0))
        except CollectiveFailure as exc:
            error = str(exc)
    up = guard.agree_up()
    row["raise"] = {"error": error, "up": up, "seconds": time.perf_counter() - start, "down": guard.down}
    return row


def main() -> int:
    modes, out = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    for mode in modes:
        row = {"raise": _raise, "count": _count, "startup": _startup, "tiers": _tiers,
               "placement": _placement}[mode](rank)
        with open(f"{out}.{mode}.rank{rank}.json", "w", encoding="utf-8") as f:
            json.dump(row, f)
    # No destroy_process_group: a group left out of step by the injected failure must not block the exit.
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The rows are on disk. Skip the interpreter's teardown: a gloo group left with an abandoned
    # collective can abort in its C++ destructors ("terminate called without an active
    # exception", seen once under load), which would turn a passed rank into a crash.
    os._exit(code)
