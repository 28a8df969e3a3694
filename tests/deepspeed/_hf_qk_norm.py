"""Small torch modules that mirror the Hugging Face attention layouts with a QK-norm.

transformers is not installed in the test legs, so these reproduce what the monitors depend on:
the attribute names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``,
``head_dim``, a ``config`` with ``num_attention_heads`` / ``num_key_value_heads``), the norm
class names and their forward formulas, and where the norm is applied:

* ``qwen3`` -- ``Qwen3Attention``: ``q_norm(q_proj(x).view(..., heads, head_dim))``, with
  ``Qwen3RMSNorm(head_dim)`` (``weight * x / rms``);
* ``gemma3`` -- ``Gemma3Attention``: the same place, ``Gemma3RMSNorm(head_dim)`` scales by
  ``1 + weight`` (weight initialised to zeros);
* ``olmo2`` -- ``Olmo2Attention``: ``q_norm(q_proj(x))`` over the whole projection,
  ``Olmo2RMSNorm(heads * head_dim)`` (``k_norm``: ``kv_heads * head_dim``), then the view;
* ``cohere`` -- ``CohereAttention`` with ``use_qk_norm``: ``CohereLayerNorm((heads, head_dim))``
  on the viewed heads (mean and variance over ``head_dim``, one gamma row per head, no bias);
* ``layernorm`` -- ``torch.nn.LayerNorm(head_dim)`` per head (centring and a bias);
* ``unknown`` -- a norm class mechmon does not know (``HeadScale``: an RMSNorm under another name);
* ``misnamed`` -- ``ScaledRMSNorm``: named an RMSNorm, scales by ``1 + weight`` (not in the
  zero-centred list: its output contradicts the name's formula).

RoPE is left out: it rotates the query and key after the norm by a position-dependent orthogonal
map, which is not part of the weights the monitors read.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 8
EPS = 1e-6
KINDS = ("qwen3", "gemma3", "olmo2", "cohere", "layernorm")


def config() -> SimpleNamespace:
    """The fields of a Hugging Face config the attention modules read."""
    return SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           head_dim=HEAD_DIM, rms_norm_eps=EPS)


class Qwen3RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Olmo2RMSNorm(Qwen3RMSNorm):
    """Same formula as Qwen3's (HF: ``(self.weight * hidden_states).to(input_dtype)``)."""


class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (output * (1.0 + self.weight.float())).type_as(x)


class ScaledRMSNorm(Gemma3RMSNorm):
    """Gemma's ``1 + weight`` under a name the zero-centred list does not hold."""


class CohereLayerNorm(nn.Module):
    def __init__(self, hidden_size, eps: float = EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)


class HeadScale(nn.Module):
    """A per-head RMS scale whose class name says neither RMSNorm nor LayerNorm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _norms(kind: str) -> tuple[nn.Module, nn.Module]:
    """``(q_norm, k_norm)`` of ``kind`` (module docstring)."""
    if kind == "olmo2":
        return Olmo2RMSNorm(HEADS * HEAD_DIM), Olmo2RMSNorm(KV_HEADS * HEAD_DIM)
    if kind == "cohere":
        return CohereLayerNorm((HEADS, HEAD_DIM)), CohereLayerNorm((KV_HEADS, HEAD_DIM))
    per_head = {"qwen3": Qwen3RMSNorm, "gemma3": Gemma3RMSNorm, "layernorm": lambda d: nn.LayerNorm(d, eps=EPS),
                "unknown": HeadScale, "misnamed": ScaledRMSNorm}[kind]
    return per_head(HEAD_DIM), per_head(HEAD_DIM)


class QKNormAttention(nn.Module):
    """A Hugging Face-style attention module with a QK-norm of ``kind`` (module docstring)."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        super().__init__()
        self.kind = kind
        self.config = config()
        self.head_dim = HEAD_DIM
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.q_norm, self.k_norm = _norms(kind)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) / HIDDEN ** 0.5)
            for norm in (self.q_norm, self.k_norm):  # gammas away from their identity value
                offset = 0.0 if isinstance(norm, Gemma3RMSNorm) else 1.0
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) - 0.5 + offset)
                if getattr(norm, "bias", None) is not None:
                    norm.bias.copy_(torch.randn(norm.bias.shape, generator=g) * 0.1)

    def query_key(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised query ``[..., heads, head_dim]`` and key ``[..., kv_heads, head_dim]``."""
        shape = (*x.shape[:-1], -1, HEAD_DIM)
        if self.kind == "olmo2":  # Olmo2Attention: the norm on the flat projection, then the view
            return self.q_norm(self.q_proj(x)).view(shape), self.k_norm(self.k_proj(x)).view(shape)
        return self.q_norm(self.q_proj(x).view(shape)), self.k_norm(self.k_proj(x).view(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[batch, seq, hidden]`` -> ``[batch, seq, hidden]`` (causal softmax attention)."""
        q, k = self.query_key(x)
        v = self.v_proj(x).view(*x.shape[:-1], -1, HEAD_DIM)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], HEADS * HEAD_DIM))


class Block(nn.Module):
    def __init__(self, kind: str, seed: int) -> None:
        super().__init__()
        self.self_attn = QKNormAttention(kind, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(x)


class TinyModel(nn.Module):
    """Residual attention blocks, one per kind (``layers.i.self_attn`` -> layer i + 1); the loss
    is the mean squared error to a target."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(kind, seed) for seed, kind in enumerate(kinds)])

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return (x - target).pow(2).mean()
