"""Fold a per-head query/key normalisation (QK-norm) into the projection rows it follows.

With ``qk_layernorm`` (Qwen3, OLMo 2/3 in megatron-core) each head's query and key pass through a
norm over their ``head_dim`` channels after the projection: ``q_h = g_q * P (W_q,h x) / s(x)``,
where ``g_q`` ``[head_dim]`` is the learned scale (gamma), ``s(x)`` the input-dependent RMS or
standard deviation, and ``P`` the centring ``I - 11^T / head_dim`` for a LayerNorm (the identity for
an RMSNorm). The logit ``q_h . k_h`` is then the bilinear form of

    A_h = diag(g_q) P W_q,h      and      B_h = diag(g_k) P W_k,h        (``[head_dim, hidden]``)

scaled by ``1 / (s_q s_k)``, which depends on the input, not on the weights, and is left out as
for every norm in front of a projection (docs/METHOD.md section 3). A LayerNorm's bias adds a term
linear in one token, not part of the bilinear form, and is left out like a projection bias.
``qk_l2_norm`` has no gamma and no centring: nothing to fold.

Folding is done in float64: a product of two float32 (or bf16) numbers is exact in float64, so the
increment of the folded rows, ``A_h(t) - A_h(t - delta)``, keeps the precision the kernels rely on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class NormFold:
    """One per-head norm after a projection, as the Q/K kernels need it.

    ``gamma``: ``[head_dim]`` the effective scale shared by every head (a zero-centred gamma
    already has its 1 added), or ``[heads, head_dim]`` one scale per head (a norm over the whole
    projection, OLMo-2 style: its input-dependent factor is shared by all heads and left out as
    for a per-head norm), any real float dtype, or None (ones: an L2 norm or a norm without a
    learned scale).
    ``centres``: the norm subtracts the mean over the ``head_dim`` channels (LayerNorm).
    """

    gamma: Optional[Tensor] = None
    centres: bool = False

    @property
    def is_identity(self) -> bool:
        """Folding changes nothing (no scale, no centring)."""
        return self.gamma is None and not self.centres


def fold_norm(rows: Tensor, norm: Optional[NormFold]) -> Tensor:
    """The effective projection rows ``diag(gamma) P W`` of each head.

    Args:
        rows: ``[heads, head_dim, hidden]`` projection rows (Megatron layout), any real float dtype.
        norm: the norm after the projection (None or an identity fold: ``rows`` is returned as is).

    Returns:
        ``[heads, head_dim, hidden]`` float64 folded rows on ``rows.device`` (or ``rows`` itself).

    Raises:
        ValueError: ``gamma`` is neither ``[head_dim]`` nor ``[heads, head_dim]``.
    """
    if norm is None or norm.is_identity:
        return rows
    out = rows.to(torch.float64)
    if norm.centres:
        out = out - out.mean(dim=-2, keepdim=True)
    if norm.gamma is not None:
        heads, head_dim = rows.shape[-3], rows.shape[-2]
        gamma = norm.gamma.to(device=rows.device, dtype=torch.float64)
        if gamma.numel() == head_dim:
            gamma = gamma.reshape(head_dim)
        elif gamma.numel() == heads * head_dim:
            gamma = gamma.reshape(heads, head_dim)
        else:
            raise ValueError(f"QK-norm gamma has {gamma.numel()} entries; expected {head_dim} (one per channel) "
                             f"or {heads} x {head_dim} (one per head and channel)")
        out = out * gamma[..., None]
    return out
