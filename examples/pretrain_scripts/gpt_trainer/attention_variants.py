"""Attention variants of the model: multi-head latent attention (MLA) and per-head QK-norm.

Flags (Megatron-LM's spellings and defaults): ``--multi-latent-attention``, ``--q-lora-rank``
(None: no query latent, queries from ``linear_q_proj``), ``--kv-lora-rank``, ``--qk-head-dim``
(the no-RoPE part of a query/key head), ``--qk-pos-emb-head-dim`` (the RoPE part), ``--v-head-dim``;
``--qk-layernorm``; ``--normalization``.

MLA (DeepSeek-V2/V3, megatron-core's ``MLASelfAttention`` from its local layer spec): queries and
keys have head dim ``d_qk = qk_head_dim + qk_pos_emb_head_dim``, values ``d_v = v_head_dim``;
the RoPE key part is shared by every head; ``--qk-layernorm`` puts a norm on the query latent
(``q_layernorm``, ``[q_lora_rank]``) and on the key/value latent (``kv_layernorm``,
``[kv_lora_rank]``). RoPE is plain (``rope_type="rope"``, no YaRN: the softmax scale megatron-core
passes is then exactly ``1 / sqrt(d_qk)``).

Without MLA, ``--qk-layernorm`` puts a per-head norm (gamma ``[kv_channels]``) on every query and
key head of the GQA ``SelfAttention`` (``q_layernorm``, ``k_layernorm``), as OLMo-2 and Qwen3 do.

Norm type: ``--normalization`` (default LayerNorm, as the trainer has always built, and RMSNorm
with MLA, as megatron-core's ``MLATransformerConfig`` and DeepSeek-V3 do; mechmon's MLA kernel
folds RMSNorm latent gammas).
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any


def add_attention_variant_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("attention variants (multi-head latent attention, QK-norm)")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="Multi-head latent attention (DeepSeek-V3, megatron-core MLASelfAttention); needs "
                        "--attention-backend torch or emulated-lowp-fa.")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="MLA query latent rank (default: no query latent, one linear_q_proj).")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="MLA key/value latent rank.")
    g.add_argument("--qk-head-dim", type=int, default=128, help="MLA query/key head dim without RoPE.")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="MLA query/key head dim with RoPE.")
    g.add_argument("--v-head-dim", type=int, default=128, help="MLA value head dim.")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="Norm queries and keys: per head (GQA), or the query and key/value latents (MLA; "
                        "needs --q-lora-rank).")
    g.add_argument("--normalization", default=None, choices=["LayerNorm", "RMSNorm"],
                   help="Norm type of every norm (default: LayerNorm; RMSNorm with --multi-latent-attention).")


def validate_attention_variant(args: argparse.Namespace) -> None:
    """ValueError for a combination that would not build or would build a different model on
    different megatron-core releases."""
    if not args.multi_latent_attention:
        return
    if args.attention_backend == "local" and not _local_attention_takes_head_dims():
        raise ValueError("--multi-latent-attention needs --attention-backend torch or emulated-lowp-fa: "
                         "megatron-core's local DotProductAttention has no separate query/key and value "
                         "head dims (k_channels, v_channels).")
    refuse_mla_tensor_parallel(args)
    if args.num_query_groups not in (None, args.num_attention_heads):
        raise ValueError("--multi-latent-attention has no query groups (every head has its own key and "
                         f"value); unset --num-query-groups (got {args.num_query_groups}).")
    if args.kv_channels is not None:
        raise ValueError("--kv-channels has no effect with --multi-latent-attention; set --qk-head-dim, "
                         "--qk-pos-emb-head-dim and --v-head-dim.")
    # Without a query latent megatron-core 0.16 builds no query norm (a kv-latent norm only) while
    # 0.19 fuses a norm into linear_q_proj, which only Transformer Engine provides: refused rather
    # than a different model per release.
    if args.qk_layernorm and args.q_lora_rank is None:
        raise ValueError("--multi-latent-attention --qk-layernorm needs --q-lora-rank (the query latent "
                         "the query norm acts on).")
    for flag in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    if args.qk_pos_emb_head_dim % 2:
        raise ValueError(f"--qk-pos-emb-head-dim must be even (RoPE rotates pairs), got {args.qk_pos_emb_head_dim}.")
    if args.q_lora_rank is not None and args.q_lora_rank < 1:
        raise ValueError(f"--q-lora-rank must be >= 1, got {args.q_lora_rank}.")


MLA_TENSOR_PARALLEL_GRADIENTS_OK = False
"""Whether MLA may train under tensor parallelism here (False: megatron-core's local MLA gives wrong
gradients there; a test driver that sets the weights itself, and so never uses them, sets True)."""


def refuse_mla_tensor_parallel(args: argparse.Namespace) -> None:
    """ValueError for MLA with ``--tensor-model-parallel-size > 1`` (see the comment inside)."""
    if MLA_TENSOR_PARALLEL_GRADIENTS_OK:
        return
    # Measured in this trainer against TP=1 (same seed, layout-independent init): with megatron-core's
    # local MLA under tensor parallelism each rank's slice of linear_kv_down_proj's RoPE-key rows gets
    # only its own heads' share of the gradient (the key RoPE part is all-gathered and used by every
    # head, and the gather's backward keeps this rank's columns of a per-rank partial sum); without
    # sequence parallelism finalize_model_grads also sums q_layernorm's already complete gradient over
    # TP (its rule is for per-head query norms). Refused rather than trained with wrong gradients.
    if args.tensor_model_parallel_size > 1:
        raise ValueError("--multi-latent-attention needs --tensor-model-parallel-size 1: megatron-core's local "
                         "MLA gives wrong gradients under tensor parallelism (the RoPE-key rows of "
                         "linear_kv_down_proj, and q_layernorm without --sequence-parallel).")


def normalization(args: argparse.Namespace) -> str:
    """The norm type the model gets: ``--normalization``, else RMSNorm with MLA (megatron-core's
    ``MLATransformerConfig`` default), else LayerNorm (``TransformerConfig``'s)."""
    if args.normalization is not None:
        return args.normalization
    return "RMSNorm" if args.multi_latent_attention else "LayerNorm"


def _local_attention_takes_head_dims() -> bool:
    """Whether the installed megatron-core's local ``DotProductAttention`` accepts ``k_channels``
    (MLA passes it; 0.16 and 0.19 refuse it)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return "k_channels" in inspect.signature(DotProductAttention.__init__).parameters


def config_class_and_kwargs(args: argparse.Namespace) -> tuple[type, dict[str, Any]]:
    """The TransformerConfig class and the attention-variant keyword arguments for it."""
    from megatron.core.transformer import TransformerConfig

    # Only what the flags set: without them the config is today's, bit for bit.
    kwargs: dict[str, Any] = {}
    if args.normalization is not None:
        kwargs["normalization"] = args.normalization
    if args.qk_layernorm:
        kwargs["qk_layernorm"] = True
    if not args.multi_latent_attention:
        return TransformerConfig, kwargs
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kwargs.update(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                  qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, rope_type="rope",
                  normalization=normalization(args))
    return MLATransformerConfig, kwargs


def layer_spec_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Attention-variant keyword arguments of ``get_gpt_layer_local_spec`` (the same in megatron-core
    0.16 and 0.19). ``normalization="RMSNorm"`` is passed because apex's ``FusedLayerNorm``, the
    local norm where apex is installed, has no RMSNorm: megatron-core then switches its local norm
    to the torch one (process-wide, its own doing); without apex that is already the local norm."""
    kwargs: dict[str, Any] = dict(qk_layernorm=args.qk_layernorm,
                                  multi_latent_attention=args.multi_latent_attention)
    if normalization(args) == "RMSNorm":
        kwargs["normalization"] = "RMSNorm"
    if args.multi_latent_attention:
        patch_mla_without_transformer_engine()
    return kwargs


def patch_mla_without_transformer_engine() -> bool:
    """Let megatron-core's ``MLASelfAttention`` build without Transformer Engine; True if patched.

    Without Transformer Engine, megatron-core 0.16's ``extensions.transformer_engine`` still imports
    (it stands a ``MagicMock`` in for ``transformer_engine``), so ``multi_latent_attention`` takes
    ``HAVE_TE = True`` and a ``TELinear`` that is a mock, not a class; its constructor's
    ``isinstance(self.linear_proj, TELinear)`` then raises TypeError. A class that nothing is an
    instance of keeps that test, and ``submodules.linear_q_down_proj in [TELinear]``, False: the
    local ``ColumnParallelLinear`` branch, which is what they mean without Transformer Engine.
    Feature-detected: where ``TELinear`` is a class (Transformer Engine installed) or ``None``
    (megatron-core 0.19 without it, guarded by a real ``HAVE_TE``) nothing changes.
    """
    import megatron.core.transformer.multi_latent_attention as mla

    if not hasattr(mla, "TELinear") or mla.TELinear is None or isinstance(mla.TELinear, type):
        return False
    mla.TELinear = type("NoTransformerEngineLinear", (), {})
    return True
