"""The detector's own cost per check, whole-job detector vs the 0.1 per-stream rule, one process.

    python tools/bench_detector.py [--layers 80 --heads 64 --moe-layers 60 --checks 60] --json

Feeds both detectors the same synthetic healthy streams (Gaussian noise around slow drifts): per
layer one Delta2 entropy per head and two full-matrix dW entropies, per MoE layer the routing
entropy and the router similarity, i.e. the streams one check of that job produces on the writer
rank. Prints microseconds per check for each (after ``--warmup`` checks that fill the baselines)
and their ratio, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from mechmon_megatron.detect.null_model import JobShape, load_tail_table, thresholds_for_job
from mechmon_megatron.detect.pooled_cusum import Observation, PooledCusumDetector, default_sequential_config
from mechmon_megatron.research.study.per_stream_rule import feed_per_stream, per_stream_bank


def synthetic_check(step: int, layers: int, heads: int, moe_layers: int, rng: random.Random) -> list[Observation]:
    drift = 1e-5 * step
    out = []
    for layer in range(1, layers + 1):
        for h in range(heads):
            out.append(Observation("attn_delta2", layer, f"head_{h}", 2.0 - drift + rng.gauss(0, 0.05)))
        out.append(Observation("attn_dw", layer, "dw_entropy", 3.0 + rng.gauss(0, 0.03)))
        out.append(Observation("attn_dw", layer, "dwk_entropy", 3.0 + rng.gauss(0, 0.03)))
    for layer in range(1, moe_layers + 1):
        out.append(Observation("router_entropy", layer, "token_entropy", 1.5 - drift + rng.gauss(0, 0.02),
                               limit=0.69))
        out.append(Observation("router_weights", layer, "weight_similarity", 0.01 + rng.gauss(0, 0.002)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--moe-layers", type=int, default=60)
    p.add_argument("--checks", type=int, default=60, help="Timed checks (after the warm-up).")
    p.add_argument("--warmup", type=int, default=50, help="Untimed checks first (fills the baselines).")
    p.add_argument("--interval", type=int, default=100)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rng = random.Random(0)
    checks = [synthetic_check(i, args.layers, args.heads, args.moe_layers, rng)
              for i in range(1, args.warmup + args.checks + 1)]
    shape = JobShape(layers={"attn_delta2": args.layers, "attn_dw": args.layers,
                             "router_entropy": args.moe_layers, "router_weights": args.moe_layers},
                     interval=args.interval, overlap=1)
    thresholds, _ = thresholds_for_job(shape, 0.01, load_tail_table())
    pooled = PooledCusumDetector(thresholds, default_sequential_config(args.interval))
    bank = per_stream_bank()
    timings = {}
    for name, feed in (
        ("pooled_cusum", lambda step, obs: pooled.update(step, obs)),
        ("per_stream_0_1", lambda step, obs: feed_per_stream(bank, step, obs)),
    ):
        for i, obs in enumerate(checks[: args.warmup]):
            feed(args.interval * (i + 1), obs)
        start = time.perf_counter()
        for i, obs in enumerate(checks[args.warmup:], start=args.warmup):
            feed(args.interval * (i + 1), obs)
        timings[name] = 1e6 * (time.perf_counter() - start) / args.checks
    result = {
        "streams_per_check": len(checks[0]),
        "us_per_check": timings,
        "ratio_pooled_to_per_stream": timings["pooled_cusum"] / timings["per_stream_0_1"],
        "us_per_stream_check": {k: v / len(checks[0]) for k, v in timings.items()},
        "shape": {"layers": args.layers, "heads": args.heads, "moe_layers": args.moe_layers},
    }
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
