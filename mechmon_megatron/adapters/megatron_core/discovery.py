"""Find the attention layers and MoE routers of megatron-core model chunks.

Works on DDP-wrapped or bare chunks, local and Transformer Engine specs, and virtual pipeline
chunks; layers are identified by megatron-core's GLOBAL 1-based ``layer_number``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch


@dataclass
class FoundAttention:
    layer_number: int
    name: str
    module: Any  # megatron.core.transformer.attention.SelfAttention, or MLASelfAttention
    kind: str = "self_attention"
    """``self_attention`` (fused ``linear_qkv``) or ``mla`` (multi-head latent attention)."""


@dataclass(frozen=True)
class LeftOut:
    """A sequence-mixing layer the attention monitors do not cover, and why (named at start-up)."""

    layer_number: Optional[int]
    name: str
    reason: str


_LEFT_OUT_BY_CLASS: dict[str, str] = {
    "MambaMixer": "Mamba SSM mixer (no softmax attention)",
    "GatedDeltaNet": "gated DeltaNet (linear attention, no softmax logits)",
    "DSAIndexer": "DSA indexer (its scores only pick the tokens; the MLA it feeds is monitored)",
    "AbsorbedMLASelfAttention": "absorbed MLA (no separate key up projection)",
    "CrossAttention": "cross-attention (queries and keys from different inputs)",
}


@dataclass
class FoundRouter:
    layer_number: int
    name: str
    module: Any  # megatron.core.transformer.moe.router.TopKRouter


@dataclass(frozen=True)
class RouterSettings:
    """What the router monitors need to know of one megatron-core router.

    ``score_function``: ``moe_router_score_function`` (``softmax``, ``sigmoid``, ``sqrtsoftplus``
    in megatron-core 0.19); ``drops_tokens``: an expert capacity is set
    (``moe_expert_capacity_factor``); ``pad_to_capacity``: the routing map also marks padding
    slots (``moe_pad_expert_input_to_capacity``).
    """

    score_function: str = "softmax"
    drops_tokens: bool = False
    pad_to_capacity: bool = False


def router_settings(router: Any) -> RouterSettings:
    """The router's settings, read from the module and its ``config`` (absent fields: defaults).

    Feature-detected rather than pinned to a release: ``TopKRouter`` keeps ``score_function``
    as an attribute (0.16 to 0.20), its ``config`` the rest.
    """
    config = getattr(router, "config", None)
    score = getattr(router, "score_function", None) or getattr(config, "moe_router_score_function", None)
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    drops = capacity is not None and float(capacity) >= 0  # megatron-core maps a negative factor to None
    pad = drops and bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
    return RouterSettings(score_function=str(score or "softmax"), drops_tokens=drops, pad_to_capacity=pad)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (each keeps the wrapped model in ``.module``)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _is_self_attention(module: torch.nn.Module) -> bool:
    return (
        hasattr(module, "linear_qkv")
        and hasattr(module, "layer_number")
        and hasattr(module, "num_attention_heads_per_partition")
    )


def _is_router(module: torch.nn.Module) -> bool:
    return (
        hasattr(module, "gating")
        and hasattr(module, "topk")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, "routing")
    )


def _is_mla(module: torch.nn.Module) -> bool:
    return (type(module).__name__ not in _LEFT_OUT_BY_CLASS and hasattr(module, "layer_number")
            and hasattr(module, "config")
            and (hasattr(module, "linear_kv_down_proj") or hasattr(module, "linear_qkv_down_proj")))


def _left_out_reason(module: torch.nn.Module) -> Optional[str]:
    """Why a sequence-mixing module is not monitored (None: not such a module)."""
    cls = type(module).__name__
    if cls in _LEFT_OUT_BY_CLASS:
        return _LEFT_OUT_BY_CLASS[cls]
    if (cls.endswith("Attention") and hasattr(module, "layer_number") and hasattr(module, "linear_proj")
            and hasattr(module, "core_attention")):
        return f"{cls}: an attention layout the monitors do not know"
    return None


def find_left_out(model_chunks: Iterable[torch.nn.Module]) -> list[LeftOut]:
    """Sequence-mixing layers of this rank's chunks that the attention monitors do not cover
    (Mamba, gated DeltaNet, DSA indexers, absorbed MLA, cross- or unknown attention)."""
    left: list[LeftOut] = []
    for chunk_index, chunk in enumerate(model_chunks):
        for name, module in unwrap(chunk).named_modules():
            if _is_self_attention(module) or _is_mla(module):
                continue
            reason = _left_out_reason(module)
            if reason is not None:
                layer = getattr(module, "layer_number", None)
                left.append(LeftOut(None if layer is None else int(layer), f"chunk{chunk_index}.{name}", reason))
    return left


def find_modules(model_chunks: Iterable[torch.nn.Module]) -> tuple[list[FoundAttention], list[FoundRouter]]:
    """All self-attention (fused ``linear_qkv`` or multi-head latent) and router modules of this
    rank's chunks, sorted by global layer."""
    attention: list[FoundAttention] = []
    routers: list[FoundRouter] = []
    for chunk_index, chunk in enumerate(model_chunks):
        for name, module in unwrap(chunk).named_modules():
            label = f"chunk{chunk_index}.{name}"
            if _is_self_attention(module):
                attention.append(FoundAttention(int(module.layer_number), label, module))
            elif _is_mla(module):
                attention.append(FoundAttention(int(module.layer_number), label, module, kind="mla"))
            elif _is_router(module):
                layer = getattr(module, "layer_number", None)
                if layer is None:
                    raise ValueError(f"router {label} has no layer_number; megatron-core sets it in TransformerLayer")
                routers.append(FoundRouter(int(layer), label, module))
    attention.sort(key=lambda f: f.layer_number)
    routers.sort(key=lambda f: f.layer_number)
    return attention, routers
