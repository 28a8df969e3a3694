"""Core-attention backends for ``--attention-backend`` and the fault-injection flags.

``local`` keeps megatron-core's ``DotProductAttention``. ``torch`` (scaled-dot-product
attention: a real FlashAttention-2 kernel on a GPU in BF16), ``emulated-lowp-fa`` (the pure
PyTorch emulation of BF16 FlashAttention with the fault injector), ``flash-attn`` and ``fp8`` (GPU
only) come from ``mechmon_megatron.research.faults.attention_backends``.

The fault acts only through the emulated kernel's backward (``delta = rowsum(dO * O)`` with a
biased O); it never writes weights. ``--fa-fault-strength`` is in BF16 ulps and is an AMPLIFIED
fault: the faithful tied-row variant rarely triggers in small models (see docs/RESULTS.md).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

ATTENTION_BACKENDS = ("local", "torch", "emulated-lowp-fa", "flash-attn", "fp8")


def add_attention_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("attention backend and fault injection")
    g.add_argument("--attention-backend", default="local", choices=ATTENTION_BACKENDS,
                   help="Core attention implementation (see gpt_trainer/attention.py).")
    g.add_argument("--fa-fault-strength", type=float, default=0.0,
                   help="Biased-rounding fault in the emulated FA backward, in BF16 ulps (0 = off).")
    g.add_argument("--fa-fault-onset", type=int, default=0, help="First iteration with the fault.")
    g.add_argument("--fa-fault-mode", default="all_rows", choices=["all_rows", "tied_rows"],
                   help="all_rows: amplified fault on every row; tied_rows: only rows with a tied max.")
    g.add_argument("--fa-fault-layers", type=str, default=None,
                   help="Comma-separated global layer numbers with the fault (default: all).")
    g.add_argument("--fa-fp32-o", action="store_true", help="Control arm: keep O in FP32 (no BF16 rounding).")
    g.add_argument("--fa-tie-shift-beta", type=float, default=None,
                   help="Opt-in mitigation: shift tied row maxima by beta (Qiu & Yao), e.g. 4.")
    g.add_argument("--fa-no-bf16-emulation", action="store_true",
                   help="Run the emulated kernel in plain FP32 (exactness checks).")
    g.add_argument("--log-max-attention-logit", action="store_true",
                   help="megatron-core's max attention logit (max over heads and layers of max_ij q.k/sqrt(d), "
                        "read with megatron.core.optimizer.qk_clip.clip_qk) per step: metrics JSONL max_attn_logit.")


def prepare_attention(args: argparse.Namespace) -> None:
    """Validate the flags and create the shared fault object on ``args``."""
    args.fa_fault = None
    if args.fa_fault_strength != 0.0 and args.attention_backend != "emulated-lowp-fa":
        raise ValueError("--fa-fault-strength needs --attention-backend emulated-lowp-fa "
                         f"(got --attention-backend {args.attention_backend}).")
    if args.attention_backend == "local":
        if args.log_max_attention_logit:  # megatron's local DotProductAttention records no max logit
            raise ValueError("--log-max-attention-logit needs --attention-backend torch or emulated-lowp-fa.")
        return
    from mechmon_megatron.research.faults.attention_backends import MAX_LOGIT_BACKENDS, backend_unavailable_reason
    from mechmon_megatron.research.faults.fault_config import FaultConfig

    reason = backend_unavailable_reason(args.attention_backend)
    if reason is not None:
        raise ValueError(f"--attention-backend {args.attention_backend}: {reason}")
    layers = None
    if args.fa_fault_layers:
        try:
            layers = tuple(int(x) for x in args.fa_fault_layers.split(",") if x.strip())
        except ValueError as exc:
            raise ValueError(
                f"--fa-fault-layers must be comma-separated integers, got {args.fa_fault_layers!r}"
            ) from exc
    if args.attention_backend == "emulated-lowp-fa":
        args.fa_fault = FaultConfig(strength=args.fa_fault_strength, onset_step=args.fa_fault_onset,
                                    mode=args.fa_fault_mode, layer_numbers=layers)
    if args.log_max_attention_logit and args.attention_backend not in MAX_LOGIT_BACKENDS:
        raise ValueError(f"--log-max-attention-logit needs --attention-backend one of {MAX_LOGIT_BACKENDS}.")


def core_attention_spec(args: argparse.Namespace) -> Optional[Any]:
    """The ``core_attention`` submodule for the layer spec (None = megatron-core default)."""
    if args.attention_backend == "local":
        return None
    from mechmon_megatron.research.faults.attention_backends import build_core_attention_spec
    from mechmon_megatron.research.faults.emulated_fa import EmulatedFAConfig

    emulation = EmulatedFAConfig(emulate_bf16=not args.fa_no_bf16_emulation, fp32_o=args.fa_fp32_o,
                                 tie_shift_beta=args.fa_tie_shift_beta)
    return build_core_attention_spec(args.attention_backend, fault=args.fa_fault, emulation=emulation)


class AttentionStepCallback:
    """Advances the fault's step counter and reports megatron-core's max attention logit per step."""

    name = "attention"

    def __init__(self, args: argparse.Namespace) -> None:
        self.fault = getattr(args, "fa_fault", None)
        self.log_max_logit = bool(getattr(args, "log_max_attention_logit", False))
        self.model_chunks: list = []

    def on_train_start(self, ctx: Any) -> None:
        self.model_chunks = list(ctx.model_chunks)

    def on_step_start(self, iteration: int) -> None:
        if self.fault is not None:
            self.fault.set_step(iteration)

    def step_metrics(self) -> dict:
        """Collective (every rank): megatron-core's ``clip_qk(model, log_max_only=True)``, the value
        Megatron-LM's ``train_step`` logs (max over this rank's layers and heads, all-reduced over
        data parallelism), then the maximum over the model-parallel ranks so the row covers every
        layer and head."""
        if not self.log_max_logit:
            return {}
        import torch
        from megatron.core import parallel_state
        from megatron.core.optimizer.qk_clip import clip_qk

        value = torch.tensor([clip_qk(megatron_lm_chunks(self.model_chunks), log_max_only=True)], dtype=torch.float64)
        # megatron-core 0.19 resets the layers' running maxima in clip_qk; 0.16 keeps them (a
        # running max since the first step): reset here so the value is this step's on both.
        for chunk in self.model_chunks:
            for module in chunk.module.modules():
                if getattr(module, "current_max_attn_logits", None) is not None:
                    module.current_max_attn_logits = None
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_model_parallel_group())
        return {"max_attn_logit": float(value.item())}


def megatron_lm_chunks(model_chunks: list) -> list:
    """``clip_qk`` walks ``chunk.module.module.decoder`` (Megatron-LM's DDP(Float16Module(GPTModel))
    nesting); our FP32 chunks are DDP(GPTModel): give those the missing level."""
    from types import SimpleNamespace

    return [chunk if hasattr(chunk.module, "module") else SimpleNamespace(module=SimpleNamespace(module=chunk.module))
            for chunk in model_chunks]


AttentionCallbackFactory = Callable[[argparse.Namespace], list]
