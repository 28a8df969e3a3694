"""Where Q/K and router weights sit in a flat state dict, and how to cut them into heads.

The layouts are those the DeepSpeed adapter knows on live modules
(``adapters/deepspeed/attention_layouts.py``), recognised here by parameter names, since a
checkpoint has no modules:

=================  =====================================================  ==========================
layout             parameter (suffix)                                     rows
=================  =====================================================  ==========================
``megatron_qkv``   ``linear_qkv.weight`` (megatron-core),                 per query group
                   ``query_key_value.weight`` (Megatron-DeepSpeed)        ``[q x r | k | v]``
``separate``       ``q_proj.weight`` + ``k_proj.weight`` (Hugging Face)    ``[heads*hd]``, ``[groups*hd]``
``stacked_qkv``    ``qkv_proj.weight``, ``Wqkv.weight``, ``in_proj_weight``  ``[q | k | v]``
``gpt2_c_attn``    ``c_attn.weight`` (GPT-2 ``Conv1D``, input-major)       columns ``[q | k | v]``
=================  =====================================================  ==========================

MoE routers: ``mlp.router.weight`` (megatron-core), ``gate.wg.weight`` (DeepSpeed MoE),
``block_sparse_moe.gate.weight`` (Mixtral), ``mlp.gate.weight`` (Qwen-MoE / DeepSeek style),
each ``[num_experts, hidden]``.

The layer number of a parameter is its first integer path component + 1
(``model.layers.3.self_attn.q_proj.weight`` -> layer 4), as the DeepSpeed adapter numbers modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.readers.base import HeadCounts, HeadHints
from mechmon_megatron.session.qkv_layout import split_qk

__all__ = ["AttentionKeys", "find_layer_keys", "resolve_heads", "split_heads"]

Layout = Literal["megatron_qkv", "separate", "stacked_qkv", "gpt2_c_attn"]

_FUSED_SUFFIXES: tuple[tuple[str, Layout], ...] = (
    ("linear_qkv.weight", "megatron_qkv"),
    ("query_key_value.weight", "megatron_qkv"),
    ("qkv_proj.weight", "stacked_qkv"),
    ("Wqkv.weight", "stacked_qkv"),
    ("in_proj_weight", "stacked_qkv"),
    ("c_attn.weight", "gpt2_c_attn"),
)
_ROUTER_SUFFIXES = ("mlp.router.weight", "gate.wg.weight", "block_sparse_moe.gate.weight", "mlp.gate.weight")
_INDEX = re.compile(r"(?:^|\.)(\d+)\.")


@dataclass(frozen=True, slots=True)
class AttentionKeys:
    """The state-dict keys of one layer: its Q/K tensors (one fused key, or q and k) and router."""

    layer: int
    layout: Layout
    keys: tuple[str, ...]
    router: Optional[str] = None


def _layer_index(key: str) -> Optional[int]:
    match = _INDEX.search(key)
    return int(match.group(1)) if match else None


def find_layer_keys(keys: Iterable[str], where: str, layer_offset: int = 0) -> dict[int, AttentionKeys]:
    """Global layer number -> its keys. ``layer_offset``: layers held by earlier pipeline stages
    (legacy Megatron files number their layers locally). Optimizer entries are ignored."""
    fused: dict[int, tuple[str, Layout]] = {}
    q: dict[int, str] = {}
    k: dict[int, str] = {}
    routers: dict[int, str] = {}
    for key in keys:
        if key.startswith("optimizer") or "._extra_state" in key:
            continue
        index = _layer_index(key)
        if index is None:
            continue
        layer = index + 1 + layer_offset
        for suffix, layout in _FUSED_SUFFIXES:
            if key.endswith(suffix):
                fused.setdefault(layer, (key, layout))
        if key.endswith("q_proj.weight") and not key.endswith("qkv_proj.weight"):
            q.setdefault(layer, key)
        elif key.endswith("k_proj.weight"):
            k.setdefault(layer, key)
        if any(key.endswith(s) for s in _ROUTER_SUFFIXES):
            routers.setdefault(layer, key)
    out: dict[int, AttentionKeys] = {}
    for layer in sorted(set(fused) | set(q)):
        if layer in fused:
            key, layout = fused[layer]
            out[layer] = AttentionKeys(layer, layout, (key,), routers.get(layer))
        elif layer in k:
            out[layer] = AttentionKeys(layer, "separate", (q[layer], k[layer]), routers.get(layer))
        else:
            raise ScanInputError(f"{where}: layer {layer} has {q[layer]!r} but no matching k_proj.weight.")
    return out


def resolve_heads(layout: Layout, shapes: Mapping[str, tuple[int, ...]], hints: HeadHints, where: str) -> HeadCounts:
    """Head counts of one layer from its stored shapes and the known numbers (``hints``)."""
    shape_list = list(shapes.values())
    need = "pass --num-attention-heads (and --num-query-groups for GQA)"
    heads = hints.num_heads
    if heads is None:
        raise ScanInputError(
            f"{where}: the checkpoint does not record the number of attention heads ({layout} Q/K layout); {need}."
        )
    if layout == "separate":
        q_rows, k_rows = shape_list[0][0], shape_list[1][0]
        head_dim = hints.head_dim or (q_rows // heads if q_rows % heads == 0 else 0)
        if not head_dim or q_rows != heads * head_dim or k_rows % head_dim:
            raise ScanInputError(
                f"{where}: q_proj has {q_rows} rows and k_proj {k_rows}, which do not split into {heads} heads "
                f"(head_dim {hints.head_dim or 'unknown'}); check --num-attention-heads / --kv-channels."
            )
        groups = k_rows // head_dim
    else:
        rows = shape_list[0][1] if layout == "gpt2_c_attn" else shape_list[0][0]
        groups = hints.num_groups or heads
        if hints.head_dim:
            head_dim = hints.head_dim
        elif rows % (heads + 2 * groups) == 0:
            head_dim = rows // (heads + 2 * groups)
        else:
            head_dim = 0
        if not head_dim or rows != head_dim * (heads + 2 * groups):
            raise ScanInputError(
                f"{where}: the fused QKV weight has {rows} rows, expected head_dim x (heads + 2 groups) with "
                f"{heads} heads and {groups} groups; check --num-attention-heads / --num-query-groups / --kv-channels."
            )
    if heads % groups:
        raise ScanInputError(f"{where}: {heads} heads are not a multiple of {groups} key/value groups.")
    return HeadCounts(num_heads=heads, num_groups=groups, head_dim=head_dim)


def split_heads(layout: Layout, tensors: list[torch.Tensor], counts: HeadCounts) -> tuple[torch.Tensor, torch.Tensor]:
    """``wq`` ``[heads, head_dim, hidden]`` and ``wk`` ``[groups, head_dim, hidden]`` of one layer."""
    h, g, d = counts.num_heads, counts.num_groups, counts.head_dim
    if layout == "megatron_qkv":
        return split_qk(tensors[0], h, g, d)
    if layout == "separate":
        return tensors[0].reshape(h, d, -1), tensors[1].reshape(g, d, -1)
    w = tensors[0].t() if layout == "gpt2_c_attn" else tensors[0]  # Conv1D stores [in, out]
    return w[: h * d].reshape(h, d, -1), w[h * d : h * d + g * d].reshape(g, d, -1)
