"""QK-norms of Hugging Face-style attention modules, folded into the Q/K rows the monitors read.

Three shapes occur (docs/DEEPSPEED.md, "QK-norm"):

per head (Qwen3, Gemma 3, Qwen3-Next)
    ``q_norm`` / ``k_norm`` over the ``head_dim`` channels of each head, after the projection:
    ``q_h = g * P (W_q,h x) / s_h(x)``. Folded as in megatron-core (``monitors/norm_fold.py``): the
    check receives a :class:`NormFold` and uses the rows ``diag(g) P W_q,h``.
per head, one gamma per head (Cohere's ``CohereLayerNorm((heads, head_dim))``)
    statistics per head as above, but ``g`` is ``[heads, head_dim]``: head ``h`` uses its own row
    ``g_h`` (``diag(g_h) P W_q,h``).
whole projection (OLMo 2 / OLMo 3)
    ``q_norm`` over all ``heads * head_dim`` channels of ``q_proj``'s output (``k_norm`` over
    ``groups * head_dim``): ``q = g * (W_q x) / s(x)`` with one RMS ``s(x)`` for all heads. Cut
    per head, ``q_h = g_h * (W_q,h x) / s(x)`` with ``g_h`` the head's slice of ``g``: the logit
    ``q_h . k_h`` is the bilinear form of ``diag(g_h) W_q,h`` and ``diag(g_k,h) W_k,h`` times
    ``1 / (s_q(x) s_k(x))``. That factor depends on the input only -- here it is shared by the
    heads instead of being each head's own, which changes nothing in the weights -- and is left
    out as for the per-head norm: the fold is exact in the same sense.
    The last two hand the check a ``[heads, head_dim]`` gamma in their :class:`NormFold`; the
    check folds every kind the same way, in float64, and the per-head dW spectra stay those of
    the projection's own update.
    A LayerNorm over the whole projection would centre across heads (a head's rows would mix
    with the other heads'): not folded, the layer is monitored without it.

The kind is read from the class name (``RMSNorm`` in it: no centring; ``LayerNorm``: centring),
the zero-centred gamma (``1 + weight``: Gemma, Qwen3-Next) from a ``zero_centered_gamma``
attribute or the class name. Where the weight is whole on this rank (not a ZeRO-3 partition) one
forward of the norm on a probe checks that reading: a norm whose output is not the formula its
name implies is not folded. A norm that is not folded leaves the layer monitored without the fold,
with one start-up warning naming the layer and the norm's class (never an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mechmon_megatron.adapters.deepspeed.weights import is_zero3_param
from mechmon_megatron.monitors.norm_fold import NormFold

# HF norms that scale by ``1 + weight`` (weight initialised to zeros). Gemma 3n's ``Gemma3nRMSNorm``
# scales by ``weight`` and is not one of them; the probe below catches the ones not listed.
ZERO_CENTRED_CLASSES = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm"})
_PROBE_SCALE, _PROBE_SHIFT = 100.0, 300.0  # a mean-square of ~1e5 makes any eps in the norm negligible


class NormNotFolded(ValueError):
    """A norm after the Q or K projection that the monitors cannot fold; the message says why."""


@dataclass(frozen=True)
class QKNorm:
    """One norm on the projected queries or keys, as the adapter folds it.

    ``path``: its module path relative to the attention module (for messages);
    ``weight``: its gamma parameter (None: no learned scale); ``centres``: subtracts the mean
    (LayerNorm); ``plus_one``: the parameter stores ``gamma - 1``; ``scope``:

    * ``"head"``: statistics and one ``[head_dim]`` gamma per head (Qwen3, Gemma 3);
    * ``"heads"``: statistics per head, a ``[n, head_dim]`` gamma, one row per head (Cohere);
    * ``"whole"``: statistics over the whole projection, ``n * head_dim`` gammas (OLMo 2).
    """

    path: str
    weight: Optional[torch.nn.Parameter]
    centres: bool
    plus_one: bool
    scope: str


# ---------------------------------------------------------------------------------- detection
def _shape(param: torch.Tensor) -> tuple[int, ...]:
    # ZeRO-3 partitions parameters in place: the original shape is kept in ds_shape.
    return tuple(int(n) for n in (getattr(param, "ds_shape", None) or param.shape))


def _is_identity(module: Optional[torch.nn.Module]) -> bool:
    return module is None or type(module).__name__ in ("Identity", "IdentityOp")


def _centres(cls: str, path: str) -> bool:
    lower = cls.lower()
    if "rmsnorm" in lower:
        return False
    if "layernorm" in lower:
        return True
    raise NormNotFolded(f"{path} ({cls}): a norm class mechmon does not know (neither RMSNorm nor LayerNorm)")


def _plus_one(module: torch.nn.Module) -> bool:
    own = getattr(module, "zero_centered_gamma", None)
    if isinstance(own, bool):
        return own
    return type(module).__name__ in ZERO_CENTRED_CLASSES


def _module_at(attention: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    """The norm module at ``path``: a module path (``q_norm``) or its parameter's (``q_norm.weight``)."""
    try:
        return attention.get_submodule(path)
    except AttributeError:
        pass
    owner, _, leaf = path.rpartition(".")
    try:
        module = attention.get_submodule(owner) if owner else attention
    except AttributeError:
        return None
    return module if isinstance(getattr(module, leaf, None), torch.nn.Parameter) else None


def _norm_shape(module: torch.nn.Module, weight: Optional[torch.Tensor]) -> Optional[tuple[int, ...]]:
    """The shape the norm's statistics run over, as far as known: torch's ``normalized_shape``
    (statistics over all of it), else the weight's shape (Hugging Face norms: over the last dim)."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and shape:
        return tuple(int(n) for n in shape)
    return _shape(weight) if weight is not None else None


def _scope(module: torch.nn.Module, weight: Optional[torch.Tensor], heads: int, head_dim: int) -> Optional[str]:
    """``"head"``, ``"heads"`` or ``"whole"`` (:class:`QKNorm`), None for another width."""
    shape = _norm_shape(module, weight)
    if shape is None:
        return None
    over_all = getattr(module, "normalized_shape", None) is not None  # torch: statistics over every dim
    if shape == (head_dim,):
        return "head"
    if shape == (heads, head_dim) and not over_all:
        return "heads"
    if int(torch.Size(shape).numel()) == heads * head_dim and (len(shape) == 1 or over_all):
        return "whole"
    return None


def find_qk_norm(attention: torch.nn.Module, path: str, heads: int, head_dim: int,
                 required: bool = False) -> Optional[QKNorm]:
    """The norm at ``path`` on the output of a projection with ``heads`` heads of ``head_dim``.

    None: no norm there (absent, an identity, or an RMSNorm without a learned scale: nothing to
    fold). ``required``: ``path`` was given by the user, so a missing module is an error.

    Raises:
        NormNotFolded: a norm the monitors cannot fold (unknown class, a weight of another width,
            a LayerNorm over the whole projection, a probe output unlike the class name's formula).
        ValueError: ``required`` and nothing at ``path``.
    """
    module = _module_at(attention, path)
    if module is None and required:
        raise ValueError(f"attention_mapping: module has no norm or parameter {path!r}")
    if module is None or _is_identity(module):
        return None
    cls = type(module).__name__
    centres = _centres(cls, path)
    weight = getattr(module, "weight", None)
    if weight is not None and not isinstance(weight, torch.nn.Parameter):
        raise NormNotFolded(f"{path} ({cls}): its weight is not a parameter")
    if weight is None and not centres:
        return None  # an RMSNorm without a scale: its 1/rms is input-dependent, nothing to fold
    scope = _scope(module, weight, heads, head_dim)
    if scope is None:
        raise NormNotFolded(f"{path} ({cls}): shape {_norm_shape(module, weight)}, neither head_dim "
                            f"{head_dim} nor {heads} heads x {head_dim}")
    if scope == "whole" and centres:
        raise NormNotFolded(f"{path} ({cls}): a LayerNorm over the whole projection centres across heads, "
                            "which no per-head fold expresses")
    norm = QKNorm(path=path, weight=weight, centres=centres, plus_one=_plus_one(module), scope=scope)
    if _probe_disagrees(module, norm, _norm_shape(module, weight) or (head_dim,)):
        raise NormNotFolded(f"{path} ({cls}): its output on a probe is not the "
                            f"{'LayerNorm' if centres else 'RMSNorm'} formula its class name implies")
    return norm


# ---------------------------------------------------------------------------------- the probe
def _formula(x: torch.Tensor, norm: QKNorm, gamma: Optional[torch.Tensor],
             bias: Optional[torch.Tensor]) -> torch.Tensor:
    """What ``norm`` should output on ``x`` ``[rows, *shape]`` (float64, eps left out)."""
    dims = tuple(range(1, x.dim())) if norm.scope == "whole" else (-1,)
    if norm.centres:
        x = x - x.mean(dim=dims, keepdim=True)
    y = x / x.pow(2).mean(dim=dims, keepdim=True).sqrt()
    if gamma is not None:
        y = y * (gamma + 1.0 if norm.plus_one else gamma)
    return y + bias if bias is not None else y


def _probe_disagrees(module: torch.nn.Module, norm: QKNorm, shape: tuple[int, ...]) -> bool:
    """True when one forward of ``module`` on a probe ``[2, *shape]`` contradicts ``norm``'s
    reading of it.

    Skipped (False) where the weight is not whole here (a ZeRO-3 partition: the class name is
    trusted) and when the forward raises (a norm that wants another input shape): the probe
    only catches a name that misleads, it never refuses a norm it cannot run."""
    params = list(module.parameters(recurse=False))
    if any(is_zero3_param(p) or p.device.type == "meta" for p in params):
        return False
    dtype = params[0].dtype if params else torch.float32
    device = params[0].device if params else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, *shape, generator=g, dtype=torch.float64) * _PROBE_SCALE + _PROBE_SHIFT).to(dtype)
    try:
        with torch.no_grad():
            out = module(x.to(device))
    except Exception:  # noqa: BLE001 -- a norm the probe cannot run keeps its name's reading
        return False
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return False
    gamma = None if norm.weight is None else norm.weight.detach().to("cpu", torch.float64)
    bias = getattr(module, "bias", None) if norm.centres else None
    bias = bias.detach().to("cpu", torch.float64) if isinstance(bias, torch.Tensor) else None
    expected = _formula(x.to(torch.float64), norm, gamma, bias)
    error = (out.detach().to("cpu", torch.float64) - expected).norm() / expected.norm().clamp_min(1e-30)
    tolerance = 1e-4 if torch.finfo(dtype).bits > 16 else 3e-2  # bf16/fp16 round each output to ~4e-3
    return not bool(error <= tolerance)


# ---------------------------------------------------------------------------------- the fold
def effective_gamma(norm: QKNorm, value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The scale the norm applies (``[width]``): float64 with the 1 added when zero-centred (exact)."""
    if value is None:
        return None
    return value.to(torch.float64) + 1.0 if norm.plus_one else value


def fold_rows(rows: torch.Tensor, norm: Optional[QKNorm],
              value: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[NormFold]]:
    """``(rows, fold)`` for :class:`~mechmon_megatron.session.host.QKWeights`: the rows as read
    and the norm's :class:`NormFold` (the check folds it, as for megatron-core).

    Args:
        rows: ``[n, head_dim, hidden]`` projection rows (n heads or key groups).
        norm: the norm after the projection (None: none).
        value: its weight as read (``head_dim`` entries, or ``n * head_dim`` for a norm over the
            whole projection: one gamma per head, ``[n, head_dim]``), None without one.
    """
    if norm is None:
        return rows, None
    gamma = effective_gamma(norm, value)
    if gamma is not None and norm.scope != "head":
        gamma = gamma.reshape(rows.shape[0], rows.shape[1])
    return rows, NormFold(gamma=gamma, centres=norm.centres)


ReadParam = Callable[[torch.nn.Parameter], torch.Tensor]


def read_gamma(norm: Optional[QKNorm], read_param: ReadParam) -> Optional[torch.Tensor]:
    """The norm's weight, read like the Q/K weights (a ZeRO collective where those are)."""
    if norm is None or norm.weight is None:
        return None
    return read_param(norm.weight).reshape(-1)  # [head_dim] or [n * head_dim], heads major
