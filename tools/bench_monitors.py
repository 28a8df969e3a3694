"""Benchmark the spectral monitor kernels on one random attention layer.

Usage::

    python tools/bench_monitors.py --hidden 4096 --num-heads 32 --head-dim 128 --json
    python tools/bench_monitors.py --mla --json      # one DeepSeek-V3 MLA layer: tools/bench_mla.py

``--mla`` hands the remaining flags to ``tools/bench_mla.py`` (its defaults: a DeepSeek-V3 layer;
``--mla --help`` lists them): the exact MLA kernel against forming each head's ``A_h``, ``B_h``
explicitly and running the classic compressed kernel on them, and its JSON or table.

Synthetic layer (why: it resembles a real increment without needing a checkpoint):
``W ~ N(0, 0.02)`` elementwise; ``dW`` has elementwise RMS ``--dw-scale`` (default 1e-3), half of
its energy in a coherent rank-4 component (the low-rank direction a precision fault pushes) and
half in Gaussian noise. Weights are stored in ``--dtype`` (default float32, the master-weight dtype).

Timed per layer: ``qk_increment_singular_values`` with ``gram``, ``compressed`` and ``dense``;
``dense`` builds ``d x d`` matrices and is timed on ``--dense-heads`` heads only, then scaled
linearly to all heads (``dense_scaled: true`` in the JSON). Also timed:
``per_head_update_singular_values`` on ``dW_q`` and ``dW_k`` and ``update_singular_values`` on the
full ``[num_heads * head_dim, hidden]`` query projection (exact, and randomized with ``--rank``).
``max_rel_err``: the worst relative error of the fast methods' singular values against ``dense``
on the timed heads, over values above 1e-6 of their row's largest.

Prints one JSON object with ``--json``, a table otherwise. ``main(argv)`` returns the dict.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from mechmon_megatron.monitors import qk_increment as qk
from mechmon_megatron.monitors.update_spectrum import (
    per_head_update_singular_values,
    update_singular_values,
)
from mechmon_megatron.plan.report import cpu_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
FAST_METHODS = ("gram", "compressed")
REL_FLOOR = 1e-6
MLA_FLAG = "--mla"
# A call slower than this is timed once (the repeat would add minutes and no information).
SLOW_CALL_S = 5.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, required=True, help="model hidden size d")
    p.add_argument("--num-heads", type=int, required=True, help="query heads per layer")
    p.add_argument("--head-dim", type=int, required=True, help="head dimension h_d")
    p.add_argument("--num-groups", type=int, default=None, help="K/V groups (default: num-heads, i.e. MHA)")
    p.add_argument("--dense-heads", type=int, default=1, help="heads on which the dense reference is timed")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="storage dtype of the weights")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per fast call (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dw-scale", type=float, default=1e-3, help="elementwise RMS of the increment dW")
    p.add_argument("--rank", type=int, default=64, help="rank of the randomized full-matrix SVD")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(MLA_FLAG, action="store_true",
                   help="benchmark one MLA layer instead, with tools/bench_mla.py's flags (main() hands them over)")
    args = p.parse_args(argv)
    if args.num_groups is None:
        args.num_groups = args.num_heads
    for name in ("hidden", "num_heads", "head_dim", "num_groups", "dense_heads", "repeats", "rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_heads % args.num_groups:
        p.error("--num-heads must be divisible by --num-groups")
    args.dense_heads = min(args.dense_heads, args.num_heads)
    return args


def make_layer(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Random ``wq_prev, wk_prev, wq_now, wk_now`` in Megatron row layout (see module doc)."""
    gen = torch.Generator().manual_seed(args.seed)

    def pair(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (n, args.head_dim, args.hidden)
        w = 0.02 * torch.randn(shape, generator=gen)
        a = torch.randn(n, args.head_dim, 4, generator=gen)
        b = torch.randn(n, 4, args.hidden, generator=gen)
        coherent = (a @ b) / 2.0  # unit elementwise variance: 4 terms of variance 1, / 2^2
        noise = torch.randn(shape, generator=gen)
        dw = args.dw_scale * (coherent + noise) / 2**0.5
        dtype = DTYPES[args.dtype]
        return w.to(dtype), (w + dw).to(dtype)

    wq_prev, wq_now = pair(args.num_heads)
    wk_prev, wk_now = pair(args.num_groups)
    return wq_prev, wk_prev, wq_now, wk_now


def timed(fn: Callable[[], object], repeats: int, slow_call_s: float = SLOW_CALL_S,
          device: torch.device | None = None) -> tuple[float, object]:
    """Median wall time of ``fn`` (first call is a warm-up unless it takes over ``slow_call_s``)
    and its last result; on a CUDA ``device`` each call is timed to its synchronisation."""

    def sync() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    first = time.perf_counter() - start
    if first > slow_call_s:
        return first, result
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def max_rel_err(est: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Worst relative error over all deltas, for reference values >= REL_FLOOR * row max."""
    worst = 0.0
    for key in qk.QK_DELTA_KEYS:
        r, e = ref[key], est[key][: ref[key].shape[0]]
        mask = (r >= REL_FLOOR * r.amax(dim=-1, keepdim=True)) & (r > 0)
        if mask.any():
            worst = max(worst, ((e - r).abs()[mask] / r[mask]).max().item())
    return worst


def fp32_gram_error(wq_prev, wk_prev, wq_now, wk_now, ref) -> float:
    """Experiment: form the Grams in float32 (cheaper, tensor-core friendly), eigh/cores in fp64."""
    q0, k0 = wq_prev.float(), wk_prev.float()
    dq, dk = wq_now.float() - q0, wk_now.float() - k0
    gx, gdq = (g.double() for g in qk._block_gram(dq, q0))
    gy, gdk = (g.double() for g in qk._block_gram(dk, k0))
    rx, rdq = qk._gram_root(gx), qk._gram_root(gdq)
    ry, rdk = qk._swap_halves(qk._gram_root(gy)), qk._gram_root(gdk)
    k = min(q0.shape[-1], 2 * q0.shape[-2])
    out = qk._cores_to_singular_values(rx, rdq, ry, rdk, q0.shape[-2], k)
    return max_rel_err(out, ref)




def run(args: argparse.Namespace) -> dict:
    wq_prev, wk_prev, wq_now, wk_now = make_layer(args)
    per_group = args.num_heads // args.num_groups
    times: dict[str, float] = {}
    results = {}
    for method in FAST_METHODS:
        times[method], results[method] = timed(
            lambda m=method: qk.qk_increment_singular_values(wq_prev, wk_prev, wq_now, wk_now, method=m),
            args.repeats,
        )

    # Dense on the first K heads; give each its own copy of its K group so any K is a valid layout.
    kh = args.dense_heads
    groups = torch.arange(kh) // per_group
    dense_args = (wq_prev[:kh], wk_prev[groups], wq_now[:kh], wk_now[groups])
    start = time.perf_counter()
    ref = qk.qk_increment_singular_values(*dense_args, method="dense")
    dense_timed = time.perf_counter() - start
    times["dense"] = dense_timed * args.num_heads / kh

    times["per_head_update"], _ = timed(
        lambda: (per_head_update_singular_values(wq_prev, wq_now), per_head_update_singular_values(wk_prev, wk_now)),
        args.repeats,
    )
    full_prev = wq_prev.reshape(-1, args.hidden)
    full_now = wq_now.reshape(-1, args.hidden)
    times["full_exact"], exact = timed(lambda: update_singular_values(full_prev, full_now), args.repeats)
    times[f"full_randomized_rank{args.rank}"], rnd = timed(
        lambda: update_singular_values(full_prev, full_now, method="randomized", rank=args.rank), args.repeats
    )
    k = min(args.rank, *full_prev.shape)
    gap = exact["singular_values"][:k] - rnd["singular_values"]

    per_method_err = {m: max_rel_err(results[m], ref) for m in FAST_METHODS}
    speedups = {m: times["dense"] / times[m] for m in FAST_METHODS}
    fastest = min(FAST_METHODS, key=lambda m: times[m])
    return {
        "config": {
            "hidden": args.hidden,
            "num_heads": args.num_heads,
            "head_dim": args.head_dim,
            "num_groups": args.num_groups,
            "dtype": args.dtype,
            "dw_scale": args.dw_scale,
            "seed": args.seed,
            "repeats": args.repeats,
            "full_matrix_shape": list(full_prev.shape),
            "randomized_rank": args.rank,
        },
        "times_s": times,
        "dense_heads_timed": kh,
        "dense_timed_s": dense_timed,
        "dense_scaled": kh < args.num_heads,
        "fastest_method": fastest,
        "speedup_vs_dense": speedups[fastest],
        "speedup_vs_dense_per_method": speedups,
        "max_rel_err": max(per_method_err.values()),
        "max_rel_err_per_method": per_method_err,
        "rel_err_floor": REL_FLOOR,
        "experiments": {"fp32_gram_formation_max_rel_err": fp32_gram_error(*dense_args, ref)},
        "randomized_full": {
            "error_bound": rnd["error_bound"].item(),
            "max_gap_exact_minus_randomized": gap.max().item(),
            "min_gap_exact_minus_randomized": gap.min().item(),
            "fro_norm": rnd["fro_norm"].item(),
        },
        **environment(),
    }


def environment() -> dict:
    """Where a benchmark ran: torch, threads, CPU, Python, date (shared by the sibling benchmarks)."""
    return {
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": cpu_name(),
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(
        f"layer: hidden={cfg['hidden']} heads={cfg['num_heads']} head_dim={cfg['head_dim']} "
        f"groups={cfg['num_groups']} dtype={cfg['dtype']} | torch {report['torch_version']}, "
        f"{report['threads']} threads, {report['machine']}"
    )
    print(f"{'kernel':<28}{'time/layer [s]':>16}{'speedup vs dense':>18}{'max rel err':>14}")
    for name, t in report["times_s"].items():
        speed = report["speedup_vs_dense_per_method"].get(name)
        err = report["max_rel_err_per_method"].get(name)
        note = " (scaled)" if name == "dense" and report["dense_scaled"] else ""
        print(
            f"{name + note:<28}{t:>16.4f}{'' if speed is None else f'{speed:.0f}x':>18}"
            f"{'' if err is None else f'{err:.1e}':>14}"
        )
    fp32_err = report["experiments"]["fp32_gram_formation_max_rel_err"]
    print(f"fp32 Gram formation (experiment, not offered): max rel err {fp32_err:.1e}")


def _bench_mla() -> ModuleType:
    """``tools/bench_mla.py``, loaded from its path when ``--mla`` asks for it (it is a sibling
    script, and it imports this module for ``timed``, so not at import time)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_mla.py")
    spec = importlib.util.spec_from_file_location("bench_mla", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; print JSON (``--json``) or a table; return the report dict. With
    ``--mla``: ``tools/bench_mla.py``'s ``main`` on the other flags, and its report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if MLA_FLAG in argv:
        return _bench_mla().main([a for a in argv if a != MLA_FLAG])
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return report


if __name__ == "__main__":
    main()
