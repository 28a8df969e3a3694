"""Mechmon off / on A/B of a ~1B-parameter megatron-core GPT, one process, one device.

    python tools/gpu_check/bench_mcore_ab.py --device cuda --json-out ab.json     # the GPU check
    python tools/gpu_check/bench_mcore_ab.py --device cpu --tiny                   # CPU smoke test

mechmon_megatron comes from the installed package (``make venv`` installs the checkout editable,
with the research and testing packages this script also uses); on the GPU machine, which runs a
copy of the tree without installing it, tools/gpu_check.sh puts the checkout on ``PYTHONPATH``.

Model (default): megatron-core ``GPTModel`` with the local layer spec (no Transformer Engine) and
scaled-dot-product attention as core attention (``torch.nn.functional.scaled_dot_product_attention``,
FlashAttention-2 kernels on a GPU in BF16), 20 layers, hidden 2048, 16 heads, FFN 8192, vocab
32768, sequence 2048, micro-batch 4: 1.07B parameters. BF16 parameters under ``Float16Module``,
Megatron DDP with FP32 gradient reduction and Megatron's optimizer (Adam with FP32 main
parameters), as Megatron-LM trains with ``--bf16``. ``--tiny`` is a 2-layer FP32 model for CPU.

Protocol: ``--warmup`` untimed steps, then ``--repeats`` rounds of an ``off`` block and an ``on``
block of ``--steps-per-arm`` steps each (same model, training goes on; the ``on`` block attaches a
fresh ``MechmonCallback`` with ``--interval`` / ``--delta``, attention monitors, and closes it at
the block's end). Every step is timed to a device synchronisation after the callback. Reported:
per-arm median and mean step time, ``overhead_mean`` = mean(on) / mean(off) - 1 (checks are rare
spikes, so the mean is the amortised cost; the median hides them), mean time of check steps, the
session's own ``mechmon/overhead_ms`` and peak device memory per arm. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import torch
import torch.distributed

FULL = dict(num_layers=20, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, vocab_size=32768,
            seq_length=2048, micro_batch_size=4)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=256,
            seq_length=32, micro_batch_size=2)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="2-layer FP32 model (CPU smoke test)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps-per-arm", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--interval", type=int, default=20)
    p.add_argument("--delta", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device (use --device cpu --tiny)")
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.dtype == "bf16" and args.device == "cpu":
        p.error("--dtype bf16 needs --device cuda (megatron-core's BF16 optimizer is CUDA only)")
    args.model = dict(TINY if args.tiny else FULL)
    for key in ("num_layers", "hidden_size"):
        if getattr(args, key) is not None:
            args.model[key] = getattr(args, key)
    for key in ("warmup", "steps_per_arm", "repeats", "interval", "delta"):
        if getattr(args, key) < (0 if key == "warmup" else 1):
            p.error(f"--{key.replace('_', '-')} must be positive")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(device: str, seed: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mechmon_megatron.testing.cpu_megatron import enable_cpu_compat

    enable_cpu_compat()  # no-op with CUDA
    if device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    except Exception as exc:  # a sandbox without NCCL support: one rank needs no real collectives
        if backend == "gloo":
            raise
        print(f"bench_mcore_ab: nccl init failed ({exc}); using gloo", file=sys.stderr)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(ddp_chunk, optimizer, config)`` of the A/B model."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from mechmon_megatron.research.faults.attention_backends import build_core_attention_spec

    m, bf16 = args.model, args.dtype == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        ffn_hidden_size=m["ffn_hidden_size"], bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=args.device == "cpu", hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = build_core_attention_spec("torch")
    model: Any = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=m["vocab_size"],
                          max_sequence_length=m["seq_length"], pre_process=True, post_process=True,
                          share_embeddings_and_output_weights=True, position_embedding_type="rope")
    if args.device == "cuda":
        model.cuda(torch.cuda.current_device())
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    chunk = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=1.0, bf16=bf16, params_dtype=dtype,
                        use_distributed_optimizer=False), [chunk])
    config.grad_scale_func = optimizer.scale_loss
    return chunk, optimizer, config


def make_step(args: argparse.Namespace, chunk: Any, optimizer: Any):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    m = args.model
    device = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (m["micro_batch_size"], m["seq_length"] + 1)
    batches = [torch.randint(0, m["vocab_size"], shape, generator=gen).to(device) for _ in range(4)]
    position_ids = torch.arange(m["seq_length"], device=device).unsqueeze(0).expand(m["micro_batch_size"], -1)

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        output = model(data[:, :-1], position_ids, None, labels=data[:, 1:])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    def step(iteration: int) -> None:
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batches[iteration % len(batches)]]), model=[chunk],
            num_microbatches=1, seq_length=m["seq_length"], micro_batch_size=m["micro_batch_size"],
            forward_only=False)
        optimizer.step()

    return step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_block(args, step, chunk, optimizer, start: int, callback: Any) -> tuple[list[float], list[int]]:
    """Train ``--steps-per-arm`` steps after ``start``; return step times and the check steps."""
    ctx = SimpleNamespace(args=SimpleNamespace(tensorboard_dir=None), model_chunks=[chunk], optimizer=optimizer,
                          iteration=start, tensorboard_writer=None, save_fn=lambda it: None)
    if callback is not None:
        callback.on_train_start(ctx)
    times, checks = [], []
    for it in range(start + 1, start + args.steps_per_arm + 1):
        _sync(args.device)
        t0 = time.perf_counter()
        if callback is not None:
            callback.on_step_start(it)
        step(it)
        ctx.iteration = it
        if callback is not None:
            callback.on_step_end(it, ctx)
            if callback.session is not None and callback.session.config.is_check_step(it):
                checks.append(it - start - 1)
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    if callback is not None:
        callback.close()
    return times, checks


def _session_ms(log_dir: str) -> Optional[float]:
    path = os.path.join(log_dir, "mechmon_scalars.jsonl")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sum(float(r.get("scalars", {}).get("mechmon/overhead_ms", 0.0)) for r in rows)


def run(args: argparse.Namespace) -> dict:
    from mechmon_megatron.adapters.megatron_core import MechmonCallback
    from mechmon_megatron.session.config import MechmonConfig

    init_single_process(args.device, args.seed)
    chunk, optimizer, _ = build(args)
    params = sum(p.numel() for p in chunk.parameters())
    step = make_step(args, chunk, optimizer)
    t0 = time.perf_counter()
    for it in range(1, args.warmup + 1):
        step(it)
    _sync(args.device)
    warmup_s = time.perf_counter() - t0
    # Blocks start on a multiple of the interval, so every block sees the same check schedule.
    iteration = -(-args.warmup // args.interval) * args.interval
    arms: dict[str, dict[str, list]] = {a: {"step_s": [], "check_step_s": [], "session_ms": [], "peak_mib": []}
                                        for a in ("off", "on")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for arm in ("off", "on"):
                callback = None
                if arm == "on":
                    log_dir = os.path.join(tmp, f"on{r}")
                    callback = MechmonCallback(MechmonConfig(
                        enabled=True, interval=args.interval, delta=args.delta, monitors=("attn",), log_dir=log_dir))
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                times, checks = run_block(args, step, chunk, optimizer, iteration, callback)
                iteration += args.steps_per_arm
                arms[arm]["step_s"] += times
                arms[arm]["check_step_s"] += [times[i] for i in checks]
                if arm == "on":
                    arms[arm]["session_ms"].append(_session_ms(log_dir))
                if args.device == "cuda":
                    arms[arm]["peak_mib"].append(torch.cuda.max_memory_allocated() / 2**20)
    off, on = arms["off"]["step_s"], arms["on"]["step_s"]
    mean_off, mean_on = statistics.fmean(off), statistics.fmean(on)
    report = {
        "config": {**args.model, "dtype": args.dtype, "device": args.device, "interval": args.interval,
                   "delta": args.delta, "steps_per_arm": args.steps_per_arm, "repeats": args.repeats,
                   "warmup": args.warmup, "attention": "scaled_dot_product_attention (megatron-core local spec)",
                   "optimizer": "megatron-core Adam (FP32 main params with BF16)" if args.dtype == "bf16"
                   else "megatron-core Adam (FP32)", "parameters": params},
        "warmup_s": warmup_s,
        "median_step_s": {"off": statistics.median(off), "on": statistics.median(on)},
        "mean_step_s": {"off": mean_off, "on": mean_on},
        "overhead_mean": mean_on / mean_off - 1.0,
        "overhead_median": statistics.median(on) / statistics.median(off) - 1.0,
        "check_steps": len(arms["on"]["check_step_s"]),
        "mean_check_step_s": statistics.fmean(arms["on"]["check_step_s"]) if arms["on"]["check_step_s"] else None,
        "session_ms_per_block": arms["on"]["session_ms"],
        "peak_mib": {a: arms[a]["peak_mib"] for a in arms},
        "step_s": {a: arms[a]["step_s"] for a in arms},
        "torch": torch.__version__,
        "backend": torch.distributed.get_backend(),
        "device_name": (torch.cuda.get_device_name() if args.device == "cuda"
                        else platform.processor() or platform.machine()),
    }
    return report


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
