"""What every checkpoint reader gives the scan: one layer's Q/K (and router) weights at a time.

A reader opens one checkpoint lazily (metadata, a memory map, a safetensors header) and returns
:class:`LayerWeights` for one global layer on request, reading only that layer's tensors. The
per-head layout is the session's (``session/host.py``: ``QKWeights`` with its QK-norms, or
``MLAHeads`` for multi-head latent attention), so the scan feeds the very kernels the online
session runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Optional, Protocol

import torch

from mechmon_megatron.monitors.norm_fold import NormFold
from mechmon_megatron.session.host import MLAHeads

__all__ = ["CheckpointReader", "HeadCounts", "HeadHints", "LayerShapes", "LayerWeights", "MLADims", "NormKind"]

Normalization = Literal["LayerNorm", "RMSNorm"]


@dataclass(frozen=True, slots=True)
class HeadHints:
    """What is known of the attention layout before the shapes are read (checkpoint metadata,
    then flags override); None: unknown. Spellings are Megatron-LM's (``qk_head_dim`` is the
    no-RoPE part of an MLA query/key head, ``qk_pos_emb_head_dim`` the RoPE part)."""

    num_heads: Optional[int] = None
    num_groups: Optional[int] = None
    head_dim: Optional[int] = None
    qk_head_dim: Optional[int] = None
    qk_pos_emb_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    q_lora_rank: Optional[int] = None
    """MLA query latent rank, when the checkpoint records it (checked against the shapes)."""
    kv_lora_rank: Optional[int] = None
    """MLA key/value latent rank, when the checkpoint records it (checked against the shapes)."""
    normalization: Optional[Normalization] = None
    """Kind of the QK-norms and MLA latent norms; None: RMSNorm (docs/SCAN.md)."""
    zero_centered_gamma: Optional[bool] = None
    """The norms store ``gamma - 1`` (Megatron-LM ``--apply-layernorm-1p``, Gemma); None: False."""
    source: str = ""
    """Where the numbers came from, for error messages (``config.json``, ``args in common.pt``, flags)."""

    def override(self, other: HeadHints) -> HeadHints:
        """``other``'s known values win (flags over checkpoint metadata)."""
        known = {f.name: getattr(other, f.name) for f in fields(self)
                 if f.name != "source" and getattr(other, f.name) is not None}
        values = {f.name: getattr(self, f.name) for f in fields(self)} | known
        values["source"] = other.source if known else self.source
        return HeadHints(**values)


@dataclass(frozen=True, slots=True)
class NormKind:
    """How a checkpoint's QK-norms or MLA latent norms fold into the projections
    (``monitors/norm_fold.py``): ``centres`` (LayerNorm) and ``zero_centered_gamma`` (stored
    value is ``gamma - 1``)."""

    centres: bool = False
    zero_centered_gamma: bool = False

    def to_json(self) -> dict[str, object]:
        return {"normalization": "LayerNorm" if self.centres else "RMSNorm",
                "zero_centered_gamma": self.zero_centered_gamma}


@dataclass(frozen=True, slots=True)
class MLADims:
    """Resolved dims of one multi-head latent attention layer (Megatron-LM spellings)."""

    qk_head_dim: int
    """``d_nope``: no-RoPE query/key channels per head."""
    qk_pos_emb_head_dim: int
    """``d_rope``: RoPE query/key channels per head (the RoPE key is one head shared by all)."""
    v_head_dim: int
    """``d_v``: value channels per head (0 when only the key rows of the up projection are stored)."""
    q_lora_rank: Optional[int]
    """Query latent rank; None: queries from one ``q_proj`` of the hidden state."""
    kv_lora_rank: int


@dataclass(frozen=True, slots=True)
class HeadCounts:
    """Resolved head layout of one attention layer.

    For an MLA layer ``num_groups`` = ``num_heads`` (every head has its own key) and ``head_dim``
    = ``qk_head_dim + qk_pos_emb_head_dim``; ``mla`` holds the dims. ``norm``: how the layer's
    QK-norms (or MLA latent norms) fold; None when it has none.
    """

    num_heads: int
    num_groups: int
    head_dim: int
    mla: Optional[MLADims] = None
    norm: Optional[NormKind] = None

    def to_json(self) -> dict[str, object]:
        """For ``summary.json`` (``heads``) and the cache fingerprint."""
        out: dict[str, object] = {"num_heads": self.num_heads, "num_groups": self.num_groups,
                                  "head_dim": self.head_dim}
        if self.mla is not None:
            out["mla"] = {f.name: getattr(self.mla, f.name) for f in fields(self.mla)}
        if self.norm is not None:
            out["norm"] = self.norm.to_json()
        return out


@dataclass(frozen=True, slots=True)
class LayerShapes:
    """Stored shapes of the tensors a layer's read uses (checked equal across a series)."""

    qk: tuple[tuple[int, ...], ...]
    """Shapes of the attention tensors as stored (one fused tensor, or q and k, then any norm
    weights; for MLA the projections and latent norms)."""
    router: Optional[tuple[int, ...]] = None
    """``[num_experts, hidden]`` of the layer's MoE router, or None for a dense layer."""


@dataclass(slots=True)
class LayerWeights:
    """One layer's weights at one checkpoint (float tensors as stored, on CPU).

    Classic attention: wq ``[num_heads, head_dim, hidden]``; wk ``[num_groups, head_dim, hidden]``
    (query head i uses group ``i // (num_heads // num_groups)``); ``q_norm`` / ``k_norm`` the
    QK-norms to fold (gamma ``[head_dim]``, shared by the heads; or ``[num_heads, head_dim]`` /
    ``[num_groups, head_dim]`` for a norm over the whole projection, OLMo-2 style, one row per
    head). Multi-head latent attention: ``mla`` instead (wq, wk None). router:
    ``[num_experts, hidden]`` or None.
    """

    layer: int
    wq: Optional[torch.Tensor] = None
    wk: Optional[torch.Tensor] = None
    router: Optional[torch.Tensor] = None
    q_norm: Optional[NormFold] = None
    k_norm: Optional[NormFold] = None
    mla: Optional[MLAHeads] = None
    """The MLA layer as the live session reads it (all heads, key rows of the up projection only)."""


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
