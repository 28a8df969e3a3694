"""Presets, layout validation and the per-rank work model of the planner."""

from __future__ import annotations

import pytest

from mechmon_megatron.plan.shapes import PRESETS, ParallelLayout, PlanInputError, resolve_shape, validate
from mechmon_megatron.plan.work import rank_classes, rank_work, unit_shapes


@pytest.mark.parametrize(
    ("name", "layers", "hidden", "heads", "groups", "head_dim", "params"),
    [
        ("llama3-8b", 32, 4096, 32, 8, 128, 8.03e9),
        ("llama3-70b", 80, 8192, 64, 8, 128, 70.6e9),
        ("llama3-405b", 126, 16384, 128, 8, 128, 405.8e9),
    ],
)
def test_llama3_presets_have_the_published_shapes(name, layers, hidden, heads, groups, head_dim, params):
    s = PRESETS[name]
    assert (s.num_layers, s.hidden_size, s.num_attention_heads, s.num_query_groups, s.kv_channels) == (
        layers, hidden, heads, groups, head_dim)
    assert s.num_experts is None
    assert s.params_per_token() == pytest.approx(params, rel=0.01)


def test_deepseek_v3_preset_routers():
    s = PRESETS["deepseek-v3"]
    assert s.first_dense_layers == 3 and s.num_moe_layers == 58
    assert not s.is_moe_layer(3) and s.is_moe_layer(4)
    assert "MLA" in s.note  # the attention shapes: tests/plan/test_plan_mla.py


def _layout(tp=1, pp=1, dp=1, ep=1):
    return ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)


def test_snapshot_elements_match_a_hand_count():
    # 4 layers, hidden 16, 8 heads, 2 groups, head dim 4; TP 4 x PP 2 x DP 2.
    shape = resolve_shape(None, dict(num_layers=4, hidden_size=16, num_attention_heads=8, num_query_groups=2,
                                     kv_channels=4), dp=2)
    layout = _layout(tp=4, pp=2, dp=2)
    validate(shape, layout)
    u = unit_shapes(shape, layout)
    assert (u.heads, u.groups) == (2, 1)  # 2 groups < 4 TP ranks: each rank holds one (replicated) group
    assert u.heads_elements == (2 + 1) * 4 * 16
    assert u.full_elements == (8 * 4 + 2 * 4) * 16
    # Stage 0 holds layers 1, 2. Layer 1: heads on dp 0 (all tp), full on j = 0 -> (dp 0, tp 0).
    # Layer 2: heads on dp 1, full on j = 1 -> (dp 0, tp 1).
    w00 = rank_work(shape, layout, 0, 0, 0)
    assert (w00.head_units, w00.full_units, w00.shared_units) == (1, 1, 0)
    assert w00.snapshot_elements(u, overlap=1) == 3 * 64 + 40 * 16
    assert w00.snapshot_elements(u, overlap=2) == 2 * (3 * 64 + 40 * 16)
    w01 = rank_work(shape, layout, 0, 0, 1)
    assert (w01.head_units, w01.full_units) == (1, 1)
    w12 = rank_work(shape, layout, 1, 1, 2)  # stage 1: layers 3 (dp 0), 4 (dp 1); full j = 2, 3 -> dp 0
    assert (w12.head_units, w12.full_units) == (1, 0)
    assert w12.snapshot_elements(u, overlap=1) == 3 * 64


def test_tp1_shares_the_head_and_full_snapshot():
    shape = resolve_shape(None, dict(num_layers=4, hidden_size=16, num_attention_heads=4, kv_channels=4), dp=2)
    layout = _layout(dp=2)
    u = unit_shapes(shape, layout)
    w = rank_work(shape, layout, 0, 0, 0)  # layers 1, 3: heads and full both here
    assert (w.head_units, w.full_units, w.shared_units) == (2, 2, 2)
    assert u.heads_elements == u.full_elements
    assert w.snapshot_elements(u, overlap=1) == 2 * u.full_elements


def test_rank_classes_cover_every_rank_and_every_layer_once():
    shape = PRESETS["llama3-70b"]
    layout = _layout(tp=8, pp=4, dp=32)
    classes = rank_classes(shape, layout)
    assert sum(c.count for c in classes) == layout.world_size
    assert sum(c.count * c.work.full_units for c in classes) == shape.num_layers
    assert sum(c.count * c.work.head_units for c in classes) == shape.num_layers * layout.tp


def test_moe_routers_and_reporting_rank():
    shape = PRESETS["deepseek-v3"]
    layout = _layout(dp=1024, ep=64)
    validate(shape, layout)
    w0 = rank_work(shape, layout, 0, 0, 0)
    w5 = rank_work(shape, layout, 0, 5, 0)
    assert w0.routers == w5.routers == 58
    assert w0.reporting_routers == 58 and w5.reporting_routers == 0


@pytest.mark.parametrize(
    ("preset", "layout", "overrides", "flag"),
    [
        ("llama3-70b", dict(tp=3), {}, "--tp"),  # 64 heads
        ("llama3-8b", dict(tp=4), dict(num_attention_heads=48, num_query_groups=6), "--tp"),  # 6 vs 4 groups
        ("llama3-70b", dict(pp=3), {}, "--pp"),  # 80 layers
        ("deepseek-v3", dict(dp=1024, ep=3), {}, "--ep"),  # 256 experts
        ("deepseek-v3", dict(dp=1000, ep=8), {}, "--global-batch-size"),
        ("llama3-8b", dict(ep=2, dp=2), {}, "--ep"),  # dense model
        ("llama3-8b", dict(tp=4), dict(num_query_groups=6), "--num-query-groups"),
    ],
)
def test_bad_layouts_name_the_flag(preset, layout, overrides, flag):
    shape = resolve_shape(preset, overrides)
    with pytest.raises(PlanInputError, match=f"^{flag} ") as info:
        validate(shape, _layout(**layout))
    assert info.value.flag == flag


def test_unknown_preset_and_missing_shape_flags():
    with pytest.raises(PlanInputError, match="^--model .*not a preset"):
        resolve_shape("llama4-1t", {})
    with pytest.raises(PlanInputError, match="--hidden-size"):
        resolve_shape(None, dict(num_layers=2))
