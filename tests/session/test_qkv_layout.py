"""Our fused-QKV row layout against megatron-core's own query/key split (real SelfAttention)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mechmon_megatron.adapters.megatron_core.discovery import find_modules
from mechmon_megatron.session.qkv_layout import qkv_row_indices, split_qk


def build_gpt(num_heads: int, num_groups: int, output_gate: bool = False, num_experts: int | None = None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=num_heads,
        num_query_groups=num_groups,
        kv_channels=8,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        attention_output_gate=output_gate,
        num_moe_experts=num_experts,
        moe_router_topk=2 if num_experts else 2,
        moe_token_dispatcher_type="allgather",
        add_bias_linear=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)


@pytest.mark.parametrize("num_heads, num_groups, gate", [(4, 4, False), (4, 2, False), (4, 1, False), (4, 2, True)])
def test_row_layout_matches_megatron_split(model_parallel, num_heads, num_groups, gate):
    model = build_gpt(num_heads, num_groups, gate)
    attention, routers = find_modules([model])
    assert [a.layer_number for a in attention] == [1, 2] and routers == []
    module = attention[0].module
    hidden = torch.randn(5, 3, 32)  # [s, b, h]
    with torch.no_grad():
        out = (
            module.get_query_key_value_tensors(hidden, output_gate=gate)
            if gate
            else module.get_query_key_value_tensors(hidden)
        )
    query, key = out[0], out[1]  # [s, b, np, hn], [s, b, ng, hn]
    wq, wk = split_qk(module.linear_qkv.weight.detach(), num_heads, num_groups, 8, gate)
    torch.testing.assert_close(torch.einsum("sbh,ndh->sbnd", hidden, wq), query, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.einsum("sbh,gdh->sbgd", hidden, wk), key, rtol=1e-5, atol=1e-6)


def test_router_discovery_uses_global_layer_numbers(model_parallel):
    model = build_gpt(4, 2, num_experts=4)
    attention, routers = find_modules([model])
    assert [r.layer_number for r in routers] == [1, 2]
    assert tuple(routers[0].module.weight.shape) == (4, 32)


def test_row_indices_reject_bad_groups():
    with pytest.raises(ValueError, match="multiple of num_query_groups"):
        qkv_row_indices(6, 4, 8)
    q, k = qkv_row_indices(4, 2, 2)
    # group 0: q0 q1 k0 v0 ; group 1: q2 q3 k1 v1 (2 rows each)
    assert q.tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]
    assert k.tolist() == [[4, 5], [12, 13]]
