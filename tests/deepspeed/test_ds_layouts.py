"""Attention Q/K layouts (Megatron-DeepSpeed, Hugging Face, GPT-2, nn.MultiheadAttention, user mapping)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from mechmon_megatron.adapters.deepspeed.attention_layouts import find_attention, layer_numbers, parse_mapping

HIDDEN, HEADS, GROUPS, HD = 16, 4, 2, 4


def _plain(param: torch.Tensor) -> torch.Tensor:
    return param.detach()


def _reference(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(HEADS, HD, HIDDEN, generator=g)
    wk = torch.randn(HEADS, HD, HIDDEN, generator=g)  # enough key/value groups for MHA; GQA slices
    wv = torch.randn(HEADS, HD, HIDDEN, generator=g)
    return wq, wk, wv


class MegatronDSAttention(nn.Module):
    """Megatron-DeepSpeed ParallelAttention: fused query_key_value, rows per group [q x r | k | v]."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        wq, wk, wv = _reference()
        wk, wv = wk[:groups], wv[:groups]
        r = HEADS // groups
        blocks = [torch.cat([wq[gi * r:(gi + 1) * r].reshape(-1, HIDDEN), wk[gi], wv[gi]]) for gi in range(groups)]
        self.query_key_value = nn.Linear(HIDDEN, (HEADS + 2 * groups) * HD, bias=False)
        self.query_key_value.weight.data.copy_(torch.cat(blocks))
        self.num_attention_heads_per_partition = HEADS
        self.num_key_value_heads_per_partition = groups
        self.hidden_size_per_attention_head = HD


class HFAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        wq, wk, _ = _reference()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HD, bias=False)
        self.k_proj = nn.Linear(HIDDEN, GROUPS * HD, bias=False)
        self.v_proj = nn.Linear(HIDDEN, GROUPS * HD, bias=False)
        self.q_proj.weight.data.copy_(wq.reshape(-1, HIDDEN))
        self.k_proj.weight.data.copy_(wk[:GROUPS].reshape(-1, HIDDEN))
        self.num_heads, self.num_key_value_heads, self.head_dim = HEADS, GROUPS, HD


class Conv1D(nn.Module):
    """GPT-2's Conv1D stores its weight input-major: [in, out]."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(nx, nf))


class GPT2Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        wq, _, _ = _reference()
        wk = torch.randn(HEADS, HD, HIDDEN, generator=torch.Generator().manual_seed(1))
        self.expected = (wq, wk)
        self.c_attn = Conv1D(HIDDEN, 3 * HIDDEN)
        w = torch.cat([wq.reshape(-1, HIDDEN), wk.reshape(-1, HIDDEN), torch.zeros(HIDDEN, HIDDEN)])  # [3H, H]
        self.c_attn.weight.data.copy_(w.t())
        self.num_heads, self.head_dim = HEADS, HD


class MysteryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Parameter(torch.zeros(3 * HIDDEN, HIDDEN))


class Model(nn.Module):
    def __init__(self, layers: list) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"attn": layer}) for layer in layers])


@pytest.mark.parametrize("groups", [HEADS, GROUPS, 1])
def test_megatron_deepspeed_query_key_value(groups: int):
    found = find_attention(Model([MegatronDSAttention(groups)]))
    assert [(f.name, f.layout, f.num_heads, f.num_groups, f.head_dim) for f in found] == [
        ("layers.0.attn", "megatron_qkv", HEADS, groups, HD)]
    wq, wk = found[0].read(_plain)
    ref_q, ref_k, _ = _reference()
    torch.testing.assert_close(wq, ref_q)
    torch.testing.assert_close(wk, ref_k[:groups])


def test_hugging_face_q_proj_k_proj_gqa():
    found = find_attention(Model([HFAttention(), HFAttention()]))
    assert [(f.layout, f.num_groups) for f in found] == [("separate", GROUPS)] * 2
    wq, wk = found[1].read(_plain)
    ref_q, ref_k, _ = _reference()
    torch.testing.assert_close(wq, ref_q)
    torch.testing.assert_close(wk, ref_k[:GROUPS])
    assert layer_numbers([f.name for f in found]) == [1, 2]


def test_gpt2_c_attn_conv1d():
    module = GPT2Attention()
    found = find_attention(Model([module]))
    assert found[0].layout == "gpt2_c_attn" and found[0].head_dim == HD
    wq, wk = found[0].read(_plain)
    torch.testing.assert_close(wq, module.expected[0])
    torch.testing.assert_close(wk, module.expected[1])


def test_torch_multihead_attention():
    mha = nn.MultiheadAttention(HIDDEN, HEADS)
    found = find_attention(Model([mha]))
    assert found[0].layout == "stacked_qkv"
    wq, wk = found[0].read(_plain)
    torch.testing.assert_close(wq.reshape(HIDDEN, HIDDEN), mha.in_proj_weight[:HIDDEN].detach())
    torch.testing.assert_close(wk.reshape(HIDDEN, HIDDEN), mha.in_proj_weight[HIDDEN:2 * HIDDEN].detach())


def test_unknown_layout_one_notice_then_mapping(caplog):
    model = Model([MysteryAttention(), MysteryAttention()])
    with caplog.at_level(logging.WARNING):
        assert find_attention(model) == []
    notices = [r.getMessage() for r in caplog.records if "unknown Q/K layout" in r.getMessage()]
    assert len(notices) == 1 and "layers.0.attn, layers.1.attn" in notices[0] and "attention_mapping" in notices[0]

    mapping = parse_mapping(
        [{"match": "layers.*.attn", "layout": "stacked_qkv", "qkv": "wqkv", "num_heads": HEADS}], "m"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        found = find_attention(model, mapping)
    assert [f.name for f in found] == ["layers.0.attn", "layers.1.attn"] and found[0].head_dim == HD
    assert not caplog.records
    skip = parse_mapping([{"match": "layers.*", "skip": True}], "m")
    assert find_attention(model, skip) == []


def test_layer_numbers():
    assert layer_numbers(["blocks.3.attn", "blocks.0.attn"]) == [4, 1]
    assert layer_numbers(["enc.attn", "dec.attn"]) == [1, 2]
    assert layer_numbers(["h.0.attn", "h.0.cross"]) == [1, 2]  # shared index: module order
