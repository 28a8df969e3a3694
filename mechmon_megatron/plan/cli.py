"""``mechmon-plan`` / ``python tools/mechmon_plan.py``: the monitor's cost at a model shape and layout.

    mechmon-plan --model llama3-70b --tp 8 --pp 4 --dp 32 [--ep N] [--interval 100] [--delta D]
                 [--step-time-s T] [--weights main|model] [--device cpu|cuda] [--no-measure] [--json]
    mechmon-plan --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --multi-latent-attention \
                 --q-lora-rank 256 --kv-lora-rank 128 --qk-head-dim 64 --qk-pos-emb-head-dim 32 --v-head-dim 64

Prints one JSON object with ``--json`` (keys: docs/PERFORMANCE.md, "Frontier shapes:
mechmon-plan"), a table otherwise. Bad input (unknown preset, a layout that does not divide the
shape) exits with status 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch

from mechmon_megatron.plan.estimate import GPUS
from mechmon_megatron.plan.report import PlanOptions, build_report, format_table
from mechmon_megatron.plan.shapes import PRESETS, ParallelLayout, PlanInputError, resolve_shape

SHAPE_FLAGS = (
    ("num_layers", int), ("hidden_size", int), ("num_attention_heads", int), ("num_query_groups", int),
    ("kv_channels", int), ("ffn_hidden_size", int), ("vocab_size", int), ("num_experts", int),
    ("moe_router_topk", int), ("moe_ffn_hidden_size", int), ("first_dense_layers", int), ("seq_length", int),
    ("micro_batch_size", int), ("global_batch_size", int),
)
MLA_FLAGS = (
    ("q_lora_rank", "query latent rank (omit: no query latent, linear_q_proj)"),
    ("kv_lora_rank", "key/value latent rank"),
    ("qk_head_dim", "no-RoPE query/key head dim"),
    ("qk_pos_emb_head_dim", "RoPE query/key head dim"),
    ("v_head_dim", "value head dim"),
)
"""Megatron-LM's multi-head latent attention flags (``ModelShape`` fields of the same names)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mechmon-plan", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default=None, help=f"preset: {', '.join(sorted(PRESETS))} (or give the shape flags)")
    lay = p.add_argument_group("parallel layout")
    lay.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    lay.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (layers split evenly)")
    lay.add_argument("--dp", type=int, default=1, help="data-parallel size")
    lay.add_argument("--ep", type=int, default=1, help="expert-parallel size (inside DP)")
    shape = p.add_argument_group("model shape (override a preset or describe a custom model)")
    for name, typ in SHAPE_FLAGS:
        shape.add_argument("--" + name.replace("_", "-"), type=typ, default=None)
    mla = p.add_argument_group("multi-head latent attention (Megatron-LM's flags; all but --q-lora-rank required "
                               "with --multi-latent-attention)")
    mla.add_argument("--multi-latent-attention", action="store_true", default=None,
                     help="every attention layer is MLA (DeepSeek-V3, Kimi K2)")
    for name, text in MLA_FLAGS:
        mla.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=text)
    mon = p.add_argument_group("monitor (defaults: MechmonConfig)")
    defaults = PlanOptions()
    mon.add_argument("--interval", type=int, default=defaults.interval, help="steps between checks")
    mon.add_argument("--delta", type=int, default=defaults.delta, help="increment window in steps")
    mon.add_argument("--weights", choices=("main", "model"), default="main",
                     help="snapshot dtype: FP32 main parameters (4 B) or BF16 model weights (2 B)")
    mon.add_argument("--qk-method", choices=("gram", "compressed"), default=defaults.qk_method)
    mon.add_argument("--full-matrix-method", choices=("randomized", "exact"), default=defaults.full_matrix_method)
    mon.add_argument("--full-matrix-rank", type=int, default=defaults.full_matrix_rank)
    mon.add_argument("--wq-norm-power-iters", type=int, default=defaults.wq_norm_power_iters)
    mon.add_argument("--no-full-matrix-dw", action="store_true", help="plan without the full-matrix dW check")
    mon.add_argument("--distributed-optimizer", action="store_true",
                     help="FP32 main parameters sharded over DP (Megatron --use-distributed-optimizer): add the "
                          "per-layer DP all-reduce of the main-parameter reader")
    run = p.add_argument_group("measurement and estimate")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the kernels are timed")
    run.add_argument("--no-measure", action="store_true", help="FLOP model only (every time labelled estimated)")
    run.add_argument("--repeats", type=int, default=defaults.repeats, help="timed calls per unit (median)")
    run.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads for the measurement (default: torch's; 1 is steadier on a shared host)")
    run.add_argument("--step-time-s", type=float, default=None,
                     help="training step time; default: estimated from 6 N tokens / (ranks x peak x --mfu)")
    run.add_argument("--mfu", type=float, default=defaults.mfu, help="model FLOP utilisation for the step estimate")
    run.add_argument("--reference-gpu", choices=sorted(GPUS), default=defaults.gpu,
                     help="GPU of the FLOP-model estimate and of the step-time estimate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def plan(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv`` and build the report (raises ``PlanInputError`` for bad input)."""
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise PlanInputError("--threads", f"must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    names = [name for name, _ in SHAPE_FLAGS] + ["multi_latent_attention"] + [name for name, _ in MLA_FLAGS]
    overrides = {name: getattr(args, name) for name in names}
    shape = resolve_shape(args.model, overrides, dp=args.dp)
    layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep)
    opts = PlanOptions(
        interval=args.interval, delta=args.delta, weights=args.weights, device=args.device, measure=not args.no_measure,
        repeats=args.repeats, step_time_s=args.step_time_s, mfu=args.mfu, gpu=args.reference_gpu,
        qk_method=args.qk_method, full_matrix_method=args.full_matrix_method, full_matrix_rank=args.full_matrix_rank,
        wq_norm_power_iters=args.wq_norm_power_iters, full_matrix_dw=not args.no_full_matrix_dw,
        distributed_optimizer=args.distributed_optimizer,
    )
    report = build_report(shape, layout, opts, progress=_progress_line)
    report["json"] = bool(args.json)
    return report


def _progress_line(line: str) -> None:
    """The measurement's progress on stderr, one plain line each (stdout stays the report alone;
    the planner imports torch and the standard library only, so no progress-bar package)."""
    print(f"[mechmon] mechmon-plan: {line}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit status (2 for bad input)."""
    try:
        report = plan(argv)
    except PlanInputError as exc:
        print(f"mechmon-plan: error: {exc}", file=sys.stderr)
        return 2
    as_json = report.pop("json")
    print(json.dumps(report, indent=2) if as_json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
