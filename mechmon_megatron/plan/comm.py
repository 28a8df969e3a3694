"""Bytes per rank of a check's records exchange: what ``session/host.py`` sends, in steady state.

At a check (``MonitoringSession._exchange``, docs/ARCHITECTURE.md, "Data flow of one check"):

* every rank: its failure and error counts in one all-reduce of two float64 (16 bytes each way),
  the verdict as one int64 pair broadcast from the writer (16 bytes), and the end-of-step
  agreement, one int32 all-reduce (4 bytes each way);
* the reporting ranks (a layer's per-head or full-matrix work, a router's report; the writer
  always), in two levels (``TorchDistributedCommunicator.gather_tiered``):

  1. inside each tensor-parallel group, its reporting ranks to their owner (the writer where it
     is one of them, else the lowest TP rank): one all-reduce (MAX) of two float64 (16 bytes each
     way), then each other member sends one float64 row of ``2 + W1`` numbers (``W1``: the
     group's longest :func:`payload_values`), which the owner receives from each;
  2. the owners to the writer: the same with each owner's concatenated row, ``2 + W2`` numbers,
     ``W2`` the longest ``2 + members x (1 + W1)``.

  A group of one rank skips its level (no communication), as the guard does.

Steady state: a healthy check with the schema already sent (the first check, and a check at
which a rank's records change shape, also send the schema as an object; an alarm its alerts).
Logical payload, as the session's byte counter records it (``CollectiveGuard.counter``), and its
``messages`` (peers whose row or broadcast reaches the rank; all-reduces count none). The weights'
gathers and the routers' all-reduces are counted elsewhere (``tp_gather``, ``router_allreduce``,
``main_param_gather`` in the report).
"""

from __future__ import annotations

from mechmon_megatron.plan.shapes import ModelShape, ParallelLayout
from mechmon_megatron.plan.work import RankWork, rank_work

HEAD_PARTIALS = 9
"""Partial scalars of one layer's per-head check on one rank (``attention_check.check_heads``)."""
FULL_PARTIALS = 5
FULL_STREAMS = 2
"""``check_full``: dW_q / dW_k entropy, stable rank, ||dW||_F, ||W_q||_2; two detector streams."""
ROUTER_PARTIALS = 11
"""``router_check.router_output`` of one reporting router: similarity, eps, eight token-entropy and
load metrics, the effective experts (plus the entropy floor when one applies)."""

COUNTS_BYTES = 16  # two float64 (failures, errors), each way
VERDICT_BYTES = 16  # int64 (alarm, carries objects)
AGREEMENT_BYTES = 4  # int32, each way
WIDTH_BYTES = 16  # two float64 (longest row, any objects), each way


def router_floor_applies(shape: ModelShape) -> bool:
    """The default floor (``--mechmon-router-min-effective-experts topk``) exists for top-k > 1."""
    return shape.moe_router_topk > 1


def payload_values(work: RankWork, shape: ModelShape, layout: ParallelLayout) -> int:
    """Numbers in one rank's row (``session/payload_codec.py``): overhead, ``value, count`` per
    partial, a value per stream (and its limit, for the routing entropy with a floor)."""
    heads_local = shape.num_attention_heads // layout.tp
    floor = 1 if router_floor_applies(shape) else 0
    per_head_layer = 2 * HEAD_PARTIALS + heads_local
    per_full_layer = 2 * FULL_PARTIALS + FULL_STREAMS
    per_router = 2 * (ROUTER_PARTIALS + floor) + 2 + floor
    return 1 + work.head_units * per_head_layer + work.full_units * per_full_layer \
        + work.reporting_routers * per_router


def reports(work: RankWork) -> bool:
    return bool(work.head_units or work.full_units or work.reporting_routers)


def _row_bytes(values: int) -> int:
    """A gathered row ``[n, has_objects, values, pad]`` of ``values`` numbers (float64)."""
    return (2 + values) * 8


def check_comm_bytes(shape: ModelShape, layout: ParallelLayout) -> dict:
    """Bytes (sent + received) of one check's records exchange per rank, and the messages the
    writer receives: ``writer``; ``per_rank`` (the largest over the other ranks, with
    ``per_rank_of`` naming its kind); ``owner`` (the largest over the TP owners but the writer,
    None when there is none), ``member`` (a reporting rank that is not an owner), ``non_reporting_rank``;
    ``reporting_ranks``, ``owners`` (the second level's ranks, the writer included),
    ``writer_messages``, ``row_values`` (the longest rank row) and ``owner_row_values``."""
    world = layout.world_size
    if world == 1:
        return {"writer": 0, "per_rank": 0, "per_rank_of": None, "owner": None, "member": None,
                "non_reporting_rank": None, "reporting_ranks": 1, "owners": 1, "writer_messages": 0,
                "row_values": 0, "owner_row_values": 0}
    writer = (layout.pp - 1, layout.dp - 1, layout.tp - 1)  # Megatron's last rank writes
    # Level 1: per TP group (p, d), its reporting ranks (tp index -> row numbers).
    groups: dict[tuple[int, int], dict[int, int]] = {}
    for p in range(layout.pp):
        for d in range(layout.dp):
            for t in range(layout.tp):
                work = rank_work(shape, layout, p, d, t)
                if reports(work) or (p, d, t) == writer:
                    groups.setdefault((p, d), {})[t] = payload_values(work, shape, layout)
    # Which member owns a group does not change its bytes: every row is padded to the group's longest.
    merged = {key: 2 + len(members) * (1 + max(members.values())) for key, members in groups.items()}
    width2 = max(merged.values())
    levels2 = len(groups) > 1
    level2 = 2 * WIDTH_BYTES if levels2 else 0
    everyone = 2 * COUNTS_BYTES + VERDICT_BYTES + 2 * AGREEMENT_BYTES

    def level1(key: tuple[int, int]) -> tuple[int, int]:
        """(bytes at the owner, bytes at each other member) of group ``key``'s first level."""
        members = groups[key]
        if len(members) == 1:
            return 0, 0
        row = _row_bytes(max(members.values()))
        return 2 * WIDTH_BYTES + (len(members) - 1) * row, 2 * WIDTH_BYTES + row

    writer_key = writer[:2]
    writer_bytes = everyone + level1(writer_key)[0] + (level2 + (len(groups) - 1) * _row_bytes(width2)
                                                      if levels2 else 0)
    owner_bytes = [everyone + level1(key)[0] + level2 + _row_bytes(width2) for key in groups if key != writer_key]
    member_bytes = [everyone + level1(key)[1] for key, members in groups.items() if len(members) > 1]
    reporting = sum(len(members) for members in groups.values())
    non_reporting = everyone if reporting < world else None
    candidates = [(b, "a tensor-parallel owner") for b in owner_bytes]
    candidates += [(b, "a reporting rank") for b in member_bytes]  # every group of 2+ has a member
    if non_reporting is not None:
        candidates.append((non_reporting, "a rank that does not report"))
    per_rank, per_rank_of = max(candidates) if candidates else (everyone, "a rank that does not report")
    return {"writer": writer_bytes, "per_rank": per_rank, "per_rank_of": per_rank_of,
            "owner": max(owner_bytes) if owner_bytes else None,
            "member": max(member_bytes) if member_bytes else None,
            "non_reporting_rank": non_reporting, "reporting_ranks": reporting, "owners": len(groups),
            "writer_messages": (len(groups[writer_key]) - 1) + (len(groups) - 1),
            "row_values": max(v for members in groups.values() for v in members.values()),
            "owner_row_values": width2}
