"""Measure what mechmon-scan costs per checkpoint pair, on a series of real safetensors files.

Usage::

    python tools/bench_scan.py --hidden 2048 --num-heads 16 --num-layers 4 --checkpoints 4 --json
    python tools/bench_scan.py --series RUN_DIR --num-attention-heads 4 --json   # an existing series

Without ``--series`` it writes a Hugging Face style series (``checkpoint-N/model.safetensors``
with ``q_proj`` / ``k_proj`` / ``v_proj`` per layer, ``config.json``) into a temporary folder:
``W ~ N(0, 0.02)`` and, from one checkpoint to the next, an increment of elementwise RMS 1e-3
with half of its energy in a rank-4 component (what a precision fault pushes) and half noise, as
``tools/bench_monitors.py`` does. The values do not matter for the cost; the shapes do.

The scan runs as ``mechmon-scan`` does (readers, kernels, detector, TensorBoard, report), in
this process. Printed: the scan's own timing (``summary.json["timing"]``: read and kernel time,
seconds per pair over all layers), the whole wall time including outputs, and the peak resident
memory of the process (``ru_maxrss``) next to the size of one checkpoint, which shows that the
model is never held whole.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from typing import Optional, Sequence

import torch

from mechmon_megatron.scan import ScanConfig, run_scan


def _increment(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    rows, cols = shape
    low = torch.randn(rows, 4, generator=gen) @ torch.randn(4, cols, generator=gen)
    noise = torch.randn(rows, cols, generator=gen)
    return 1e-3 * (low / low.pow(2).mean().sqrt() + noise) / 2 ** 0.5


def write_series(root: str, hidden: int, heads: int, layers: int, checkpoints: int, step: int) -> int:
    """Write the synthetic series; returns the bytes of one checkpoint."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(layers) for p in "qkv"]
    weights = {n: 0.02 * torch.randn(hidden, hidden, generator=gen) for n in names}
    size = 0
    for c in range(1, checkpoints + 1):
        folder = os.path.join(root, f"checkpoint-{c * step}")
        os.makedirs(folder)
        save_file(weights, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump({"num_attention_heads": heads, "num_key_value_heads": heads, "hidden_size": hidden}, f)
        size = os.path.getsize(os.path.join(folder, "model.safetensors"))
        weights = {n: w + _increment(tuple(w.shape), gen) for n, w in weights.items()}
    return size


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--series", default=None, help="scan this existing run folder instead of a synthetic one")
    p.add_argument("--num-attention-heads", type=int, default=None, help="with --series, if not recorded")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--checkpoints", type=int, default=4)
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        series, size = args.series, None
        if series is None:
            series = os.path.join(tmp, "series")
            size = write_series(series, args.hidden, args.num_heads, args.num_layers, args.checkpoints, 1000)
        start = time.perf_counter()
        summary = run_scan(ScanConfig(inputs=(series,), out=os.path.join(tmp, "out"), window=args.window,
                                      num_attention_heads=args.num_attention_heads, progress=False))
        wall = time.perf_counter() - start
    result = {
        "series": args.series or f"synthetic safetensors, hidden {args.hidden}, {args.num_heads} heads, "
                                 f"{args.num_layers} layers, {args.checkpoints} checkpoints",
        "format": summary["format"],
        "pairs": summary["pairs"],
        "layers": len(summary["layers"]),
        "timing": summary["timing"],
        "wall_s_including_outputs": round(wall, 3),
        "wall_s_per_pair_including_outputs": round(wall / summary["pairs"], 4),
        "checkpoint_bytes": size,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python":
                    platform.python_version(), "torch": torch.__version__},
    }
    print(json.dumps(result, indent=1) if args.json else
          f"{result['pairs']} pairs, {result['timing']['seconds_per_pair']} s per pair (reads + kernels), "
          f"{result['wall_s_per_pair_including_outputs']} s per pair with outputs, peak RSS {result['peak_rss_mb']} MB")
    return result


if __name__ == "__main__":
    main()
