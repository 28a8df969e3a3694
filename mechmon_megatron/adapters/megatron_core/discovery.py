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
