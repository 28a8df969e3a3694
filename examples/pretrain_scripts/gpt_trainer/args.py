"""Command-line flags of the example trainer (Megatron-LM names) and their validation.

``build_parser(extra_args_providers)`` follows Megatron-LM's ``extra_args_provider`` convention:
each provider is ``fn(parser) -> parser`` and may add its own argument group (e.g. ``--mechmon*``).
"""

from __future__ import annotations

import argparse
from typing import Callable, Iterable, Optional, Sequence

import torch

from .attention import add_attention_args, prepare_attention
from .attention_variants import add_attention_variant_args, validate_attention_variant

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]



def _model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="GQA groups (default: --num-attention-heads, i.e. MHA).")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Head dim (default: hidden-size / num-attention-heads).")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="Default: 4 * hidden-size.")
    g.add_argument("--num-experts", type=int, default=None, help="MoE experts per layer (off).")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Expert FFN size (default: --ffn-hidden-size).")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "none"])
    # Routers in use today (megatron-core's names and meanings); unset = megatron-core's default.
    g.add_argument("--moe-router-score-function", default=None, choices=["softmax", "sigmoid"],
                   help="Router score function (megatron-core default: softmax).")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free balancing: a per-expert bias moves the selection (sigmoid only).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=None,
                   help="Expert-bias update per step (megatron-core default: 1e-3).")
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="Group-limited routing: groups.")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Group-limited routing: groups selected per token.")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax before the top-k (megatron-core requires it for softmax top-1).")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Expert capacity factor: assignments beyond the capacity are dropped (off).")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad every expert's input to its capacity (needs --moe-expert-capacity-factor).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of the shared experts (off).")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--vocab-size", type=int, default=257,
                   help="Tokenizer vocab (byte-level: 256 bytes + eod = 257).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad vocab to a multiple of this x TP size (as Megatron-LM).")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="Initialise every weight on CPU from a per-parameter seeded generator, "
                        "independent of the TP/PP/EP layout (same seed -> same model).")


def _training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Default: micro-batch-size x data-parallel size.")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Default: --train-iters.")
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "WSD"])
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: length of the final decay phase in iterations (stable before it).")
    g.add_argument("--lr-wsd-decay-style", default="linear",
                   choices=["linear", "cosine", "exponential", "minus_sqrt"],
                   help="WSD: shape of the final decay phase.")
    g.add_argument("--router-lr-mult", type=float, default=1.0,
                   help="Multiply the peak and minimum LR of the MoE router weights only (a "
                        "router-only learning-rate fault for the fault study); 1 = off.")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="On --load, take the LR and weight-decay schedule from these flags, not from the "
                        "checkpoint (as Megatron-LM's flag; the step count still comes from the checkpoint). "
                        "mechmon-supervise adds it with every LR remedy.")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Save (if --save) and exit when iteration %% exit-interval == 0.")
    g.add_argument("--iterations-to-skip", type=int, nargs="+", default=[],
                   help="Iterations whose data is skipped (as Megatron-LM's flag): the iteration counter and "
                        "the data advance, no forward, backward or optimizer step, no LR-scheduler step, no "
                        "metrics row, no callback (PaLM-style skipping of the batches around a loss spike).")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true",
                   help="BF16 model parameters with FP32 main parameters in the optimizer "
                        "(megatron-core mixed precision: Float16Module, FP32 grad reduction).")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard the optimizer state and FP32 main parameters over the "
                        "data-parallel group (megatron-core DistributedOptimizer).")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per process on CPU (default 1).")


def _parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="Default: nccl when CUDA is available, else gloo.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _io_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data, checkpoints, logging")
    g.add_argument("--data-path", default=None,
                   help="Prefix of a Megatron indexed dataset (PREFIX.bin/.idx, built by "
                        "tools/build_indexed_dataset.py). Default: the byte-level stdlib corpus.")
    g.add_argument("--corpus-max-bytes", type=int, default=4 * 1024 * 1024,
                   help="Cap of the default stdlib corpus in bytes.")
    g.add_argument("--save", default=None, help="Checkpoint directory.")
    g.add_argument("--load", default=None, help="Resume from this checkpoint directory.")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="With --load: resume from iter_<N> instead of the one named by "
                        "latest_checkpointed_iteration.txt (as Megatron-LM's --ckpt-step).")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--save-at-iters", type=_int_list, default=(),
                   help="Comma-separated extra iterations to save at (e.g. fork points of a study).")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-jsonl", default=None,
                   help="Per-iteration metrics file (iteration, lm_loss, grad_norm, lr, "
                        "step_time_s), written by the last rank.")
    g.add_argument("--log-interval", type=int, default=1)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def build_parser(extra_args_providers: Optional[Iterable[ArgsProvider]] = None
                 ) -> argparse.ArgumentParser:
    """The trainer's parser; each extra provider ``fn(parser) -> parser`` may add flags."""
    parser = argparse.ArgumentParser(description="Megatron-core GPT / GPT-MoE example trainer",
                                     allow_abbrev=False)
    for add in (_model_args, add_attention_variant_args, add_attention_args, _training_args, _parallel_args,
                _io_args):
        add(parser)
    for provider in extra_args_providers or ():
        parser = provider(parser)
    return parser


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Fill defaults that depend on others and reject inconsistent layouts (ValueError)."""
    tp, pp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.expert_model_parallel_size)
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by "
                         f"--tensor-model-parallel-size x --pipeline-model-parallel-size = {tp * pp}.")
    args.data_parallel_size = world_size // (tp * pp)
    if args.num_experts is None and ep != 1:
        raise ValueError("--expert-model-parallel-size > 1 needs --num-experts.")
    if args.num_experts is not None and args.num_experts % ep != 0:
        raise ValueError(f"--num-experts {args.num_experts} must be divisible by "
                         f"--expert-model-parallel-size {ep}.")
    if args.num_layers % pp != 0:
        raise ValueError(f"--num-layers {args.num_layers} must be divisible by "
                         f"--pipeline-model-parallel-size {pp}.")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    if args.num_experts is not None and tp > 1 and not args.sequence_parallel:
        raise ValueError("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                         "(megatron-core refuses MoE + TP without it).")
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step != 0:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"--micro-batch-size x data-parallel size = {per_step}.")
    args.num_microbatches = args.global_batch_size // per_step
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_decay_style == "WSD":
        if args.lr_wsd_decay_iters is None or not 0 < args.lr_wsd_decay_iters <= args.lr_decay_iters:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters in 1..--lr-decay-iters, got "
                             f"{args.lr_wsd_decay_iters}.")
    if not args.router_lr_mult > 0:
        raise ValueError(f"--router-lr-mult must be > 0, got {args.router_lr_mult}.")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    multiple = args.make_vocab_size_divisible_by * tp
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple
    prepare_attention(args)
    validate_attention_variant(args)
    return args


def parse_args(argv: Optional[Sequence[str]] = None,
               extra_args_providers: Optional[Iterable[ArgsProvider]] = None) -> argparse.Namespace:
    """Parse flags (validation that needs the world size happens in ``validate_args``)."""
    return build_parser(extra_args_providers).parse_args(argv)
