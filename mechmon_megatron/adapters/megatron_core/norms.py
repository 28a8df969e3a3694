"""Read the norms that sit inside an attention layer's query/key bilinear form.

Two places in megatron-core: the per-head QK-norm of ``SelfAttention`` (``q_layernorm`` /
``k_layernorm``, over ``head_dim`` channels, with ``qk_layernorm``; a weightless ``L2Norm`` with
``qk_l2_norm``), and the latent norms of multi-head latent attention (``q_layernorm`` /
``kv_layernorm`` over the latent, or fused into the up projection as
``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight`` with Transformer
Engine). What the monitors need from each (docs/METHOD.md sections 3b and 4b): its learned scale
gamma, with ``layernorm_zero_centered_gamma`` resolved (the module stores ``gamma - 1``), and
whether it centres (LayerNorm) or not (RMSNorm). Types are recognised by feature and name, not
imported: Transformer Engine may be absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

WeightSource = Callable[[torch.nn.Parameter], Callable[[], Optional[torch.Tensor]]]


class UnsupportedLayout(ValueError):
    """An attention module the monitor cannot decompose; the message is the reason, for the
    start-up line that names the layer left out."""


@dataclass(frozen=True)
class NormSpec:
    """One norm module as the monitors fold it: ``weight`` its gamma parameter ``[channels]``,
    ``plus_one`` the stored value is ``gamma - 1`` (zero-centred gamma), ``centres`` it subtracts
    the mean over its channels (LayerNorm)."""

    weight: torch.nn.Parameter
    plus_one: bool
    centres: bool


def _is_identity(module: Any) -> bool:
    return module is None or type(module).__name__ in ("IdentityOp", "Identity")


def _centres(module: Any, config: Any) -> bool:
    name = type(module).__name__.lower()
    if "rmsnorm" in name:
        return False
    if "layernorm" in name:
        return True
    return str(getattr(config, "normalization", "LayerNorm")) == "LayerNorm"


def _plus_one(module: Any, config: Any) -> bool:
    own = getattr(module, "zero_centered_gamma", None)
    if own is not None:
        return bool(own)
    return bool(getattr(config, "layernorm_zero_centered_gamma", False))


def norm_spec(module: Any, config: Any, what: str, channels: int) -> Optional[NormSpec]:
    """How the norm ``module`` folds (None: nothing to fold -- absent, identity, or an L2 norm
    without a learned scale).

    Raises:
        UnsupportedLayout: a norm without a 1-D ``weight`` of ``channels`` entries (the message
            names ``what`` and the module's type).
    """
    if _is_identity(module):
        return None
    weight = getattr(module, "weight", None)
    if weight is None and not any(True for _ in module.parameters()):
        return None  # L2Norm (qk_l2_norm): no learned scale, its 1/rms is input-dependent
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.numel() != channels:
        shape = None if not isinstance(weight, torch.Tensor) else tuple(weight.shape)
        raise UnsupportedLayout(f"{what} ({type(module).__name__}) has weight shape {shape}, expected ({channels},)")
    return NormSpec(weight=weight, plus_one=_plus_one(module, config), centres=_centres(module, config))


def fused_norm_spec(linear: Any, config: Any, what: str, channels: int) -> Optional[NormSpec]:
    """The norm fused into a Transformer Engine ``LayerNormColumnParallelLinear`` (its
    ``layer_norm_weight``), or None when ``linear`` has none."""
    weight = getattr(linear, "layer_norm_weight", None)
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.numel() != channels:
        raise UnsupportedLayout(f"{what} fused norm weight has shape {tuple(getattr(weight, 'shape', ()))}, "
                                f"expected ({channels},)")
    centres = str(getattr(linear, "normalization", getattr(config, "normalization", "LayerNorm"))) == "LayerNorm"
    return NormSpec(weight=weight, plus_one=_plus_one(linear, config), centres=centres)


class GammaReader:
    """Reads one norm's effective gamma (``[channels]``; float64 when zero-centred, so that the 1
    added is exact). Call on every rank that lists the site, in site order: the read may be a
    data-parallel collective (FP32 main parameters under the distributed optimizer)."""

    def __init__(self, spec: NormSpec, weight_source: Optional[WeightSource], uses: bool) -> None:
        self.spec = spec
        self._read = weight_source(spec.weight) if weight_source is not None else (lambda: spec.weight.detach())
        configure = getattr(self._read, "configure_use", None)
        if callable(configure):
            configure(uses, None)

    def __call__(self) -> Optional[torch.Tensor]:
        value = self._read()
        if value is None:
            return None  # a rank that does not use this layer (distributed optimizer)
        return value.to(torch.float64) + 1.0 if self.spec.plus_one else value
