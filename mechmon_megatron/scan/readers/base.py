"""What every checkpoint reader gives the scan: one layer's Q/K (and router) weights at a time.

A reader opens one checkpoint lazily (metadata, a memory map, a safetensors header) and returns
:class:`LayerWeights` for one global layer on request, reading only that layer's tensors. The
per-head layout is the session's (``session/host.py``: ``QKWeights``), so the scan feeds the very
kernels the online session runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

__all__ = ["CheckpointReader", "HeadCounts", "HeadHints", "LayerShapes", "LayerWeights"]


@dataclass(frozen=True, slots=True)
class HeadHints:
    """Head counts as far as they are known (checkpoint metadata, then flags override); None: unknown."""

    num_heads: Optional[int] = None
    num_groups: Optional[int] = None
    head_dim: Optional[int] = None
    source: str = ""
    """Where the numbers came from, for error messages (``config.json``, ``args in common.pt``, flags)."""

    def override(self, other: HeadHints) -> HeadHints:
        """``other``'s known numbers win (flags over checkpoint metadata)."""
        known = other.num_heads or other.num_groups or other.head_dim
        return HeadHints(
            num_heads=other.num_heads or self.num_heads,
            num_groups=other.num_groups or self.num_groups,
            head_dim=other.head_dim or self.head_dim,
            source=other.source if known else self.source,
        )


@dataclass(frozen=True, slots=True)
class HeadCounts:
    """Resolved head layout of one attention layer."""

    num_heads: int
    num_groups: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class LayerShapes:
    """Stored shapes of the tensors a layer's read uses (checked equal across a series)."""

    qk: tuple[tuple[int, ...], ...]
    """Shapes of the Q/K tensors as stored (one fused tensor, or q and k)."""
    router: Optional[tuple[int, ...]] = None
    """``[num_experts, hidden]`` of the layer's MoE router, or None for a dense layer."""


@dataclass(slots=True)
class LayerWeights:
    """One layer's weights at one checkpoint (float tensors as stored, on CPU).

    wq: ``[num_heads, head_dim, hidden]``; wk: ``[num_groups, head_dim, hidden]`` (query head i uses
    group ``i // (num_heads // num_groups)``); router: ``[num_experts, hidden]`` or None.
    """

    layer: int
    wq: torch.Tensor
    wk: torch.Tensor
    router: Optional[torch.Tensor] = None


class CheckpointReader(Protocol):
    """One checkpoint of a series. ``layers()`` and ``shapes()`` read metadata only."""

    path: str
    iteration: int
    format: str

    def layers(self) -> list[int]:
        """Global 1-based layer numbers that have Q/K weights."""

    def shapes(self) -> dict[int, LayerShapes]:
        """Stored shapes per layer (no tensor data read)."""

    def heads(self, layer: int) -> HeadCounts:
        """The resolved head layout of ``layer`` (ScanInputError when it cannot be resolved)."""

    def read_layer(self, layer: int) -> LayerWeights:
        """That layer's weights, and nothing else of the checkpoint."""
