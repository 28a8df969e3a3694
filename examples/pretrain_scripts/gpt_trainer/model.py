"""Model construction: TransformerConfig, the local layer spec, GPTModel, DDP wrapping.

``build_layer_spec(args, core_attention=None)`` is where another core-attention implementation
is injected (``--attention-backend``, see ``attention.py``).

``--use-cpu-initialization`` here means *layout-independent* initialisation
(:func:`init_params_layout_independent`): every parameter is drawn in full on the CPU from a
generator seeded by (``--seed``, its global name) -- global layer number, global expert index --
and this rank keeps its tensor-parallel shard. The same seed then gives the same model whatever
the TP/PP/EP/DP layout, which is what the parity tests rely on.
"""

from __future__ import annotations

import argparse
import math
import re
import zlib
from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import core_attention_spec
from .attention_variants import config_class_and_kwargs, layer_spec_kwargs


def build_transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """The TransformerConfig of the flags (an ``MLATransformerConfig`` with --multi-latent-attention)."""
    config_class, variant = config_class_and_kwargs(args)
    moe = {}
    if args.num_experts is not None:
        moe = dict(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
        )
        # Only the router settings that were given: without them the config is today's, bit for bit.
        optional = dict(
            moe_router_score_function=args.moe_router_score_function,
            moe_router_enable_expert_bias=args.moe_router_enable_expert_bias or None,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_num_groups=args.moe_router_num_groups,
            moe_router_group_topk=args.moe_router_group_topk,
            moe_router_pre_softmax=args.moe_router_pre_softmax or None,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity or None,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        )
        moe.update({k: v for k, v in optional.items() if v is not None})
    return config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=args.use_cpu_initialization or not torch.cuda.is_available(),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        params_dtype=model_dtype(args),
        pipeline_dtype=model_dtype(args),
        bf16=bool(getattr(args, "bf16", False)),
        add_bias_linear=False,  # with MoE the biased local path fails on an in-place add
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        log_max_attention_logit=bool(getattr(args, "log_max_attention_logit", False)),
        **moe,
        **variant,
    )


def model_dtype(args: argparse.Namespace) -> torch.dtype:
    """Model parameter dtype: BF16 with ``--bf16`` (the optimizer keeps FP32 main params), else FP32."""
    return torch.bfloat16 if getattr(args, "bf16", False) else torch.float32


def build_layer_spec(args: argparse.Namespace, core_attention: Optional[Any] = None) -> ModuleSpec:
    """The local (no Transformer Engine) GPT layer spec; ``core_attention`` replaces
    ``DotProductAttention`` (default: the ``--attention-backend`` registry entry)."""
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False,
                                    **layer_spec_kwargs(args))
    if core_attention is None:
        core_attention = core_attention_spec(args)
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def build_model(args: argparse.Namespace, config: TransformerConfig) -> GPTModel:
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.use_cpu_initialization:
        init_params_layout_independent(model, args)
    return model


def wrap_ddp(model: GPTModel, config: TransformerConfig,
             use_distributed_optimizer: bool = False) -> DistributedDataParallel:
    """Megatron DDP around ``model``; with ``config.bf16`` first a ``Float16Module`` (BF16 compute,
    FP32 loss) and gradients reduced in FP32, as Megatron-LM does for ``--bf16``."""
    if config.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(config.bf16), overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer)
    chunk = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    chunk.broadcast_params()
    config.finalize_model_grads_func = finalize_model_grads
    return chunk


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.local_experts\.(\d+)\.")


def global_param_name(model: GPTModel, name: str, args: argparse.Namespace) -> str:
    """Name of ``name`` in the single-process model: global layer and expert indices; the tied
    output layer of the last pipeline stage maps onto the word embedding."""
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    match = _LAYER_RE.match(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]
    match = _EXPERT_RE.search(name)
    if match:
        local = int(match.group(1))
        per_rank = args.num_experts // args.expert_model_parallel_size
        expert = parallel_state.get_expert_model_parallel_rank() * per_rank + local
        name = name[:match.start()] + f".local_experts.{expert}." + name[match.end():]
    return name


def _tp_coords(param: torch.nn.Parameter) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that shards ``param``."""
    if not getattr(param, "allreduce", True):  # expert parameter
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


@torch.no_grad()
def init_params_layout_independent(model: GPTModel, args: argparse.Namespace) -> None:
    """Every 1-D parameter: norm gammas 1 (the QK-norm's ``q_layernorm`` / ``k_layernorm`` and MLA's
    latent ``q_layernorm`` / ``kv_layernorm`` included), biases 0; every matrix N(0, std) by its
    global name (MLA's ``linear_q_proj`` / ``linear_q_down_proj`` / ``linear_q_up_proj`` /
    ``linear_kv_down_proj`` / ``linear_kv_up_proj`` as megatron's ``init_method``), the output
    projections ``linear_proj`` and ``linear_fc2`` with megatron's scaled std."""
    std = args.init_method_std
    out_std = std / math.sqrt(2.0 * args.num_layers)  # Megatron's scaled output init
    for name, param in model.named_parameters():
        key = global_param_name(model, name, args)
        if param.dim() == 1:  # norm weights and biases
            param.fill_(1.0 if key.endswith("weight") and "norm" in key else 0.0)
            continue
        shape = list(param.shape)
        rank, size = 0, 1
        if getattr(param, "tensor_model_parallel", False):
            rank, size = _tp_coords(param)
            shape[param.partition_dim] *= size
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + zlib.crc32(key.encode()))
        scale = out_std if key.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
        full = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
        if size > 1:
            full = full.chunk(size, dim=param.partition_dim)[rank]
        param.copy_(full.to(param.device))
