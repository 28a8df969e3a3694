"""Bytes per rank of a check's records exchange: what ``session/host.py`` sends, in steady state.

At a check (``MonitoringSession._exchange``, docs/ARCHITECTURE.md, "Data flow of one check"):

* every rank: its failure and error counts in one all-reduce of two float64 (16 bytes each way),
  the verdict as one int64 pair broadcast from the writer (16 bytes), and the end-of-step
  agreement, one int32 all-reduce (4 bytes each way);
* the reporting ranks (a layer's per-head or full-matrix work, a router's report; the writer
  always): one all-reduce (MAX) of two float64 over their group (16 bytes each way), then each
  non-writer sends one float64 row of ``2 + W`` numbers, which the writer receives from all of
  them; ``W`` is the longest row (:func:`payload_values`).

Steady state: a healthy check with the schema already sent (the first check, and a check at
which a rank's records change shape, also send the schema as an object; an alarm its alerts).
Logical payload, as the session's byte counter records it (``CollectiveGuard.counter``); the
weights' gathers and the routers' all-reduces are counted elsewhere (``tp_gather``,
``router_allreduce``, ``main_param_allreduce`` in the report).
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


def check_comm_bytes(shape: ModelShape, layout: ParallelLayout) -> dict:
    """Bytes (sent + received) of one check's records exchange: the writer's, and the largest over
    the other ranks, with the counts they follow from."""
    world = layout.world_size
    if world == 1:
        return {"writer": 0, "per_rank": 0, "per_rank_of": None, "reporting_ranks": 1, "row_values": 0}
    writer = (layout.pp - 1, layout.dp - 1, layout.tp - 1)  # Megatron's last rank writes
    reporting, width = 0, 0
    members: dict[tuple[int, int, int], int] = {}
    for p in range(layout.pp):
        for d in range(layout.dp):
            for t in range(layout.tp):
                work = rank_work(shape, layout, p, d, t)
                if reports(work) or (p, d, t) == writer:
                    reporting += 1
                    values = payload_values(work, shape, layout)
                    members[(p, d, t)] = values
                    width = max(width, values)
    row = (2 + width) * 8
    everyone = 2 * COUNTS_BYTES + VERDICT_BYTES + 2 * AGREEMENT_BYTES
    group = 2 * WIDTH_BYTES if reporting > 1 else 0
    writer_bytes = everyone + group + (reporting - 1) * row
    reporter = everyone + group + (row if reporting > 1 else 0)
    others = [m for m in members if m != writer]
    largest = reporter if others else everyone
    return {"writer": writer_bytes, "per_rank": largest, "reporting_ranks": reporting, "row_values": width,
            "per_rank_of": "a reporting rank" if others else "a rank that does not report",
            "non_reporting_rank": everyone if reporting < world else None}
