"""Core-attention backends for megatron-core layer specs (the ``core_attention=`` slot).

:class:`MechmonCoreAttention` is a drop-in replacement for
``megatron.core.transformer.dot_product_attention.DotProductAttention``: same constructor, same
``forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
packed_seq_params=None)``, inputs ``[sq, b, np, hn]`` (keys and values ``[sk, b, ng, hn]``, with
``np``/``ng`` the heads/query groups local to this tensor-parallel rank) and output
``[sq, b, np * hn]``. Multi-head latent attention (megatron-core's ``MLASelfAttention``) builds its
core attention with ``k_channels`` (the query/key head dim ``d_qk = qk_head_dim +
qk_pos_emb_head_dim``) and ``v_channels`` (``d_v = v_head_dim``), which megatron-core's local
``DotProductAttention`` refuses: here queries are ``[sq, b, np, d_qk]``, keys ``[sk, b, ng, d_qk]``,
values ``[sk, b, ng, d_v]`` and the output ``[sq, b, np * d_v]`` (``torch`` and
``emulated-lowp-fa``; ``flash-attn`` and ``fp8`` refuse ``d_qk != d_v``). The score scale is the
``softmax_scale`` given (MLA passes ``mscale**2 / sqrt(d_qk)``), else ``1 / sqrt(d_qk)``. Backends:

- ``"torch"``: ``torch.nn.functional.scaled_dot_product_attention``.
- ``"emulated-lowp-fa"``: the emulated BF16 FlashAttention of
  :mod:`mechmon_megatron.research.faults.emulated_fa`, with the optional fault injector.
- ``"flash-attn"``: ``flash_attn.flash_attn_func`` on a CUDA GPU, inputs cast to BF16.
- ``"fp8"``: Transformer Engine's ``DotProductAttention`` under ``fp8_autocast`` with FP8
  attention (``fp8_dpa``) on a GPU with FP8 support (compute capability >= 8.9).

``flash-attn`` and ``fp8`` import their package lazily and raise ``RuntimeError`` naming the
missing package or GPU when the module is built.

Masks: only the standard causal mask (``AttnMaskType.causal``) and no mask
(``AttnMaskType.no_mask``) are supported. With a causal mask type an explicit
``attention_mask`` is accepted only if it is the plain causal mask (as built by megatron's
GPT datasets); anything else (document resets, padding) raises ``ValueError``.
``apply_query_key_layer_scaling`` is a fp16 overflow trick that does not change the
mathematical scale; it is ignored here.

Max attention logit: with ``TransformerConfig.log_max_attention_logit`` (megatron-core's
``--log-max-attention-logit``) the ``torch`` and ``emulated-lowp-fa`` backends keep the per-head
maximum of ``q . k * softmax_scale`` over unmasked positions in ``current_max_attn_logits``
(``[np]``, FP32, the running maximum over forwards), the contract of Transformer Engine's
attention with ``return_max_logit``. megatron-core's own ``clip_qk(model, log_max_only=True)``
then reduces and resets it, as in Megatron-LM's ``train_step``. ``--qk-clip`` (which rescales
Q/K weights) is refused.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from mechmon_megatron.research.faults.emulated_fa import EmulatedFAConfig, emulated_flash_attention
from mechmon_megatron.research.faults.fault_config import FaultConfig

AttentionBackend = Literal["torch", "emulated-lowp-fa", "flash-attn", "fp8"]
ATTENTION_BACKENDS: tuple[str, ...] = ("torch", "emulated-lowp-fa", "flash-attn", "fp8")
MAX_LOGIT_BACKENDS: tuple[str, ...] = ("torch", "emulated-lowp-fa")  # the others never form Q K^T

_FLASH_HINT = "pip install 'mechmon-megatron[flash]' (flash-attn >= 2.6) on a machine with a CUDA GPU"
_FP8_HINT = (
    "install NVIDIA Transformer Engine (pip install transformer-engine[pytorch]) "
    "on a GPU with FP8 support"
)


def backend_unavailable_reason(backend: str) -> Optional[str]:
    """Why ``backend`` cannot run on this machine, or ``None`` if it can."""
    if backend not in ATTENTION_BACKENDS:
        return f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}"
    if backend in ("torch", "emulated-lowp-fa"):
        return None
    if not torch.cuda.is_available():
        return (
            f"attention backend {backend!r} needs a CUDA GPU and none is visible; "
            "use 'torch' or 'emulated-lowp-fa' on CPU"
        )
    if backend == "flash-attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError as err:
            return f"attention backend 'flash-attn' needs the flash-attn package ({err}); " + _FLASH_HINT
        return None
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as err:
        return f"attention backend 'fp8' needs Transformer Engine ({err}); {_FP8_HINT}"
    if torch.cuda.get_device_capability() < (8, 9):
        return (
            "attention backend 'fp8' needs a GPU with FP8 support "
            "(compute capability >= 8.9: Ada, Hopper or newer)"
        )
    return None


def _check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"Unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}."
        )
    reason = backend_unavailable_reason(backend)
    if reason is not None:
        raise RuntimeError(reason + ".")


class MechmonCoreAttention(MegatronModule):
    """Core attention with a selectable backend; see the module docstring.

    The first eight arguments are those of megatron-core's ``DotProductAttention``;
    ``k_channels`` / ``v_channels`` (query/key and value head dims, default ``config.kv_channels``)
    those of Transformer Engine's, which megatron-core's ``MLASelfAttention`` passes; ``backend``,
    ``fault`` and ``emulation`` come from the ``ModuleSpec`` params
    (:func:`build_core_attention_spec`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        *,
        backend: AttentionBackend = "torch",
        fault: Optional[FaultConfig] = None,
        emulation: Optional[EmulatedFAConfig] = None,
    ):
        super().__init__(config=config)
        _check_backend(backend)
        _check_config(config, backend, fault)
        self.backend = backend
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        _check_head_dims(backend, self.k_channels, self.v_channels)
        self.hidden_size_per_attention_head = self.v_channels  # the output's per-head width
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if backend == "emulated-lowp-fa" and self.dropout_p > 0:
            raise ValueError(
                f"attention backend 'emulated-lowp-fa' has no attention dropout; set "
                f"--attention-dropout 0 (TransformerConfig.attention_dropout=0.0), got {self.dropout_p}."
            )
        self.fault = fault if fault is not None and fault.applies_to_layer(self.layer_number) else None
        self.emulation = emulation if emulation is not None else EmulatedFAConfig()
        self.record_max_logit = bool(getattr(config, "log_max_attention_logit", False))
        self.current_max_attn_logits: Optional[Tensor] = None  # [np]; megatron's clip_qk reads and resets it
        self._te_attention = self._build_te_attention(config) if backend == "fp8" else None

    def _build_te_attention(self, config: TransformerConfig) -> torch.nn.Module:
        import transformer_engine.pytorch as te

        return te.DotProductAttention(
            num_attention_heads=self.num_attention_heads_per_partition,
            kv_channels=self.k_channels,  # == v_channels (_check_head_dims)
            num_gqa_groups=self.num_query_groups_per_partition,
            attention_dropout=self.dropout_p,
            qkv_format="sbhd",
            attn_mask_type="causal" if self.attn_mask_type == AttnMaskType.causal else "no_mask",
            softmax_scale=self.softmax_scale,
            layer_number=self.layer_number,
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        """Attend ``query [sq,b,np,d_qk]`` over ``key [sk,b,ng,d_qk]``, ``value [sk,b,ng,d_v]``;
        -> ``[sq,b,np*d_v]`` (``d_qk == d_v == hn`` except in multi-head latent attention)."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "MechmonCoreAttention supports neither packed sequences nor attention bias; "
                "use megatron's TEDotProductAttention for those."
            )
        causal = self._is_causal(attn_mask_type, attention_mask, query.shape[0], key.shape[0])
        sq, b, n_heads = query.shape[:3]
        if n_heads % key.shape[2] != 0:
            raise ValueError(
                f"{n_heads} local query heads are not a multiple of {key.shape[2]} key groups."
            )
        if self.backend == "flash-attn":
            context = self._flash_attn(query, key, value, causal)
        elif self.backend == "fp8":
            context = self._fp8(query, key, value)
        else:
            context = self._bhnd_backend(query, key, value, causal)
        return context.reshape(sq, b, n_heads * value.shape[-1])

    def _is_causal(
        self, attn_mask_type: Optional[AttnMaskType], attention_mask: Optional[Tensor], sq: int, sk: int
    ) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type == AttnMaskType.no_mask:
            return False
        if mask_type != AttnMaskType.causal:
            raise ValueError(
                f"MechmonCoreAttention supports AttnMaskType.causal and no_mask only, got {mask_type}; "
                "use megatron's DotProductAttention or TEDotProductAttention for padding masks."
            )
        if attention_mask is not None and sq > 1:
            plain = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=attention_mask.device), 1)
            if attention_mask.shape[-2:] != (sq, sk) or not bool((attention_mask.bool() == plain).all()):
                raise ValueError(
                    "MechmonCoreAttention only supports the plain causal mask; the given attention_mask "
                    "differs (document resets or padding?). Unset --reset-attention-mask or use "
                    "megatron's DotProductAttention."
                )
        return sq > 1

    def _bhnd_backend(self, query: Tensor, key: Tensor, value: Tensor, causal: bool) -> Tensor:
        """torch / emulated backends: [s,b,h,d] -> [b,h,s,d], GQA groups repeated, -> [sq,b,h,d]."""
        group_size = query.shape[2] // key.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if group_size > 1:
            k = k.repeat_interleave(group_size, dim=1)
            v = v.repeat_interleave(group_size, dim=1)
        if self.record_max_logit:
            self._update_max_logits(q, k, causal)
        if self.backend == "torch":
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=causal, scale=self.softmax_scale,
            )
        else:
            out = emulated_flash_attention(
                q, k, v, softmax_scale=self.softmax_scale, causal=causal,
                config=self.emulation, fault=self.fault,
            )
        return out.permute(2, 0, 1, 3)

    @torch.no_grad()
    def _update_max_logits(self, q: Tensor, k: Tensor, causal: bool) -> None:
        """Running per-head max of ``q [b,h,n,d] . k [b,h,m,d] * softmax_scale`` (causal: j <= i)."""
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        if causal:
            n, m = scores.shape[-2:]
            future = torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        batch_max = scores.amax(dim=(0, 2, 3))
        previous = self.current_max_attn_logits
        self.current_max_attn_logits = batch_max if previous is None else torch.maximum(previous, batch_max)

    def _flash_attn(self, query: Tensor, key: Tensor, value: Tensor, causal: bool) -> Tensor:
        from flash_attn import flash_attn_func

        q, k, v = (t.transpose(0, 1).to(torch.bfloat16) for t in (query, key, value))  # [b,s,h,d]
        out = flash_attn_func(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
            softmax_scale=self.softmax_scale, causal=causal,
        )
        return out.to(query.dtype).transpose(0, 1)

    def _fp8(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling

        recipe = DelayedScaling(fp8_dpa=True)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            out = self._te_attention(*(t.to(torch.bfloat16) for t in (query, key, value)))
        return out.to(query.dtype)


def _check_head_dims(backend: str, k_channels: int, v_channels: int) -> None:
    """ValueError when ``backend`` cannot take value heads narrower or wider than query/key heads."""
    if k_channels != v_channels and backend not in ("torch", "emulated-lowp-fa"):
        raise ValueError(
            f"attention backend {backend!r} needs equal query/key and value head dims, got "
            f"{k_channels} and {v_channels} (multi-head latent attention?); use 'torch' or 'emulated-lowp-fa'."
        )


def _check_fault(backend: str, fault: Optional[FaultConfig]) -> None:
    if fault is not None and fault.enabled and backend != "emulated-lowp-fa":
        raise ValueError(
            "fault injection acts in the emulated FA backward; use backend 'emulated-lowp-fa', "
            f"not {backend!r} (or set fault.strength = 0)."
        )


def _check_config(config: TransformerConfig, backend: str, fault: Optional[FaultConfig]) -> None:
    name = "MechmonCoreAttention"
    if getattr(config, "context_parallel_size", 1) != 1:
        raise ValueError(f"{name} does not support context parallelism; set --context-parallel-size 1.")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError(
            f"{name} supports softmax_type 'vanilla' only, got {config.softmax_type!r}; "
            "unset --softmax-type."
        )
    if getattr(config, "window_size", None) is not None:
        raise ValueError(f"{name} does not support sliding-window attention; unset --window-size.")
    if getattr(config, "qk_clip", False):
        raise ValueError(f"{name} does not support qk-clip (it rescales Q/K weights); unset --qk-clip.")
    if getattr(config, "log_max_attention_logit", False) and backend not in MAX_LOGIT_BACKENDS:
        raise ValueError(
            f"{name} records max attention logits with the backends {MAX_LOGIT_BACKENDS} only, "
            f"not {backend!r}; unset --log-max-attention-logit or change the attention backend."
        )
    _check_fault(backend, fault)


def build_core_attention_spec(
    backend: str,
    fault: Optional[FaultConfig] = None,
    emulation: Optional[EmulatedFAConfig] = None,
) -> ModuleSpec:
    """A ``ModuleSpec`` for a layer spec's ``core_attention=`` slot.

    Every layer built from the returned spec shares the same ``fault`` object: the trainer
    calls ``fault.set_step(iteration)`` once per iteration. ``emulation`` sets the emulated
    kernel's options (BF16 emulation, ``fp32_o`` control arm, tie-shift fix, tile sizes).
    Raises ``ValueError`` for an unknown backend and ``RuntimeError`` when the backend cannot
    run on this machine.
    """
    _check_backend(backend)
    _check_fault(backend, fault)
    return ModuleSpec(
        module=MechmonCoreAttention,
        params={"backend": backend, "fault": fault, "emulation": emulation},
    )
