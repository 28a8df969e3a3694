"""The planner's count of a check's records exchange against a hand count, and its growth:
the writer's bytes follow the reporting ranks, every other rank's bytes stay flat with the world."""

from __future__ import annotations

import dataclasses

from mechmon_megatron.plan.comm import check_comm_bytes
from mechmon_megatron.plan.report import PlanOptions, build_report
from mechmon_megatron.plan.shapes import PRESETS, ModelShape, ParallelLayout

TINY_MOE = ModelShape(name="tiny", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                      kv_channels=8, ffn_hidden_size=128, vocab_size=256, seq_length=16, micro_batch_size=1,
                      global_batch_size=8, num_experts=4, moe_router_topk=2)
"""The model of tools/bench_check_comm.py (the example trainer's tiny MoE GPT)."""


def test_tiny_moe_at_tp2_dp2_matches_a_hand_count():
    # Ranks (dp, tp): per-head layer 1 on replica 0, layer 2 on replica 1 (2 heads per TP rank);
    # full matrix: layer 1 on (0, 0), layer 2 on (0, 1); both routers reported by (0, 0).
    # Row numbers: 1 overhead + per-head layer (9 partials x 2 + 2 streams) = 20
    #   + full layer (5 x 2 + 2) = 12 + router (12 partials x 2 + similarity + entropy + its floor) = 27.
    # (0,0): 1 + 20 + 12 + 2 x 27 = 87 numbers; (0,1): 33; (1,0) and (1,1), the writer: 21.
    # Level 1: TP group 0 -> its owner (0,0); TP group 1 -> the writer (1,1), its own owner.
    # Level 2: the two owners; (0,0)'s concatenated row 2 + 2 x (1 + 87) = 178 numbers is the longest.
    comm = check_comm_bytes(TINY_MOE, ParallelLayout(tp=2, pp=1, dp=2))
    assert comm["row_values"] == 87 and comm["reporting_ranks"] == 4
    assert comm["owners"] == 2 and comm["owner_row_values"] == 178 and comm["writer_messages"] == 2
    everyone = 16 + 16 + 16 + 4 + 4  # counts all-reduce both ways, verdict, agreement both ways
    width = 32  # the row-width all-reduce of a level, both ways
    row1, row1_writer_group, row2 = (2 + 87) * 8, (2 + 21) * 8, (2 + 178) * 8
    assert comm["owner"] == everyone + (width + row1) + (width + row2)  # receives (0,1)'s row, sends its own
    assert comm["member"] == everyone + width + row1  # (0,1) sends its row to its owner
    assert comm["writer"] == everyone + (width + row1_writer_group) + (width + row2)
    assert comm["per_rank"] == comm["owner"] and comm["per_rank_of"] == "a tensor-parallel owner"
    assert comm["non_reporting_rank"] is None  # every rank reports something here


def test_bytes_and_writer_peers_do_not_grow_with_the_world_beyond_the_owners():
    rows = [check_comm_bytes(TINY_MOE, ParallelLayout(tp=2, pp=1, dp=dp)) for dp in (2, 4, 8, 64)]
    # Two layers: from dp 2 on, the same ranks report, whatever the world size: 4 owners' work
    # in two TP groups, plus the (non-owning) writer's group: three owners at the second level.
    assert {r["reporting_ranks"] for r in rows[1:]} == {5} and {r["owners"] for r in rows[1:]} == {3}
    assert {r["writer_messages"] for r in rows} == {2}  # flat in DP (one level: 4 peers from dp 4 on)
    assert len({r["writer"] for r in rows[1:]}) == 1 and len({r["per_rank"] for r in rows}) == 1
    assert rows[-1]["non_reporting_rank"] == 56


def test_llama3_70b_at_8192_ranks_is_in_the_plan():
    report = build_report(PRESETS["llama3-70b"], ParallelLayout(tp=8, pp=4, dp=256), PlanOptions(measure=False))
    comm = report["check_comm"]
    assert report["check_comm_bytes_per_rank"] == comm["per_rank"]
    assert report["check_comm_bytes_writer"] == comm["writer"]
    # 80 layers, each with one per-head replica of 8 TP ranks and one full-matrix rank: at most
    # 80 x 8 + 80 reporting ranks (and the writer) of 8,192, in at most 80 + 80 + 1 TP groups;
    # the writer hears from the owners only (and its own TP group), not from every reporting rank.
    assert comm["reporting_ranks"] <= 80 * 8 + 80 + 1 and comm["owners"] <= 80 + 80 + 1
    assert comm["writer_messages"] <= comm["owners"] - 1 + 7 < comm["reporting_ranks"] // 7
    assert comm["per_rank"] < 10_000 and comm["writer"] < 2_000_000
    assert comm["non_reporting_rank"] == 56


def test_one_rank_exchanges_nothing():
    assert check_comm_bytes(dataclasses.replace(TINY_MOE), ParallelLayout(tp=1, pp=1, dp=1))["writer"] == 0


def test_the_plan_equals_the_recorded_measurement():
    """``docs/data/check_comm/bench_check_comm.json`` (tools/bench_check_comm.py, the byte and
    message counter of the real trainer's collectives, steady state): the planner's writer bytes,
    largest other rank's bytes and the writer's peers equal what was measured at every world size."""
    import json
    from pathlib import Path

    record = json.loads((Path(__file__).resolve().parents[2] / "docs" / "data" / "check_comm" /
                         "bench_check_comm.json").read_text())
    measured = [r for r in record["results"] if "summary" in r]
    assert {r["ranks"] for r in measured} >= {2, 4}
    for res in measured:
        lay = res["layout"]
        plan = check_comm_bytes(dataclasses.replace(TINY_MOE, global_batch_size=lay["dp"]),
                                ParallelLayout(tp=lay["tp"], pp=lay["pp"], dp=lay["dp"]))
        rec = res["summary"]["records"]
        assert (rec["writer_bytes"], rec["max_other_bytes"], rec["writer_messages"]) == \
            (plan["writer"], plan["per_rank"], plan["writer_messages"]), res["ranks"]
