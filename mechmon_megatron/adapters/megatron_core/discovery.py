"""Find the attention layers and MoE routers of megatron-core model chunks.

Works on DDP-wrapped or bare chunks, local and Transformer Engine specs, and virtual pipeline
chunks; layers are identified by megatron-core's GLOBAL 1-based ``layer_number``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch


@dataclass
class FoundAttention:
    layer_number: int
    name: str
    module: Any  # megatron.core.transformer.attention.SelfAttention


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


def find_modules(model_chunks: Iterable[torch.nn.Module]) -> tuple[list[FoundAttention], list[FoundRouter]]:
    """All self-attention and router modules of this rank's chunks, sorted by global layer."""
    attention: list[FoundAttention] = []
    routers: list[FoundRouter] = []
    for chunk_index, chunk in enumerate(model_chunks):
        for name, module in unwrap(chunk).named_modules():
            label = f"chunk{chunk_index}.{name}"
            if _is_self_attention(module):
                attention.append(FoundAttention(int(module.layer_number), label, module))
            elif _is_router(module):
                layer = getattr(module, "layer_number", None)
                if layer is None:
                    raise ValueError(f"router {label} has no layer_number; megatron-core sets it in TransformerLayer")
                routers.append(FoundRouter(int(layer), label, module))
    attention.sort(key=lambda f: f.layer_number)
    routers.sort(key=lambda f: f.layer_number)
    return attention, routers
