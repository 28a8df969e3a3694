"""Cost per check of ``--mechmon-short-window``: the short window's kernel beside the long check.

    python tools/bench_short_window.py --hidden 128 --num-heads 4 --head-dim 32    # study model
    python tools/bench_short_window.py --hidden 8192 --num-heads 8 --num-groups 1 --head-dim 128  # frontier

Times, on one synthetic attention layer (``W ~ N(0, 0.02)``, increments of RMS 1e-3 over each
window), the session's own functions: ``check_heads`` (long window: Delta1/2/3 and per-head dW
spectra), ``check_full`` (full-matrix dW, randomized rank 128 as shipped) and
``check_heads_short`` (short window: Delta2 per head and its leading singular pair, one core SVD,
``monitors/leading_direction.py``). Prints one JSON object: medians in ms and
the short window's share of the check. Wall times on a shared machine: compare the ratios
within one run, not the absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from mechmon_megatron.session.attention_check import check_full, check_heads, check_heads_short
from mechmon_megatron.session.host import FullQK, QKWeights


def _interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each call, the calls interleaved round by round (a shared machine's
    load then weighs on all of them alike)."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(1000.0 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--num-heads", type=int, required=True, help="query heads on this rank")
    p.add_argument("--num-groups", type=int, default=None, help="K groups on this rank (default: num-heads)")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    groups = args.num_groups or args.num_heads
    g = torch.Generator().manual_seed(0)

    def weights(n: int) -> torch.Tensor:
        return torch.randn(n, args.head_dim, args.hidden, generator=g) * 0.02

    wq, wk = weights(args.num_heads), weights(groups)
    dq_long, dk_long = weights(args.num_heads) * 0.05, weights(groups) * 0.05
    dq_short, dk_short = dq_long / 5, dk_long / 5
    now = QKWeights(wq, wk, 0)
    long_prev = QKWeights(wq - dq_long, wk - dk_long, 0)
    short_prev = QKWeights(wq - dq_short, wk - dk_short, 0)
    full_now = FullQK(wq.reshape(-1, args.hidden), wk.reshape(-1, args.hidden))
    full_prev = FullQK(long_prev.wq.reshape(-1, args.hidden), long_prev.wk.reshape(-1, args.hidden))
    ms = _interleaved_ms({
        "check_heads": lambda: check_heads(1, long_prev, now, 2.0, "gram", False),
        "check_full": lambda: check_full(1, full_prev, full_now, 2.0, "randomized", 128, 16),
        "check_heads_short": lambda: check_heads_short(1, short_prev, now, 2.0, "gram", False),
    }, args.repeats)
    long_check = ms["check_heads"] + ms["check_full"]
    out = {
        "shape": {"hidden": args.hidden, "num_heads": args.num_heads, "num_groups": groups,
                  "head_dim": args.head_dim}, "threads": args.threads, "repeats": args.repeats,
        "median_ms": {k: round(v, 3) for k, v in ms.items()},
        "short_over_long_check": round(ms["check_heads_short"] / long_check, 4),
        "short_over_check_heads": round(ms["check_heads_short"] / ms["check_heads"], 4),
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
