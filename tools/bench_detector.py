"""The detector's own cost per check, whole-job detector vs the 0.1 per-stream rule, one process.

    python tools/bench_detector.py [--layers 80 --heads 64 --moe-layers 60 --checks 60] --json

Feeds both detectors the same synthetic healthy streams (Gaussian noise around slow drifts): per
layer one Delta2 entropy per head and two full-matrix dW entropies, per MoE layer the routing
entropy and the router similarity, i.e. the streams one check of that job produces on the writer
rank. Prints microseconds per check for each (after ``--warmup`` checks that fill the baselines)
and their ratio, measured in one run.

``young``: the whole-job detector early in training, while every baseline is young, with and
without the early-phase correction (the shipped phase moments: interval 20, delta 100, the
calibration runs' schedule), fed the same checks from step 100 (checks 10-40 timed, all in measured
phase bins), and their ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from mechmon_megatron.detect.null_model import JobShape, load_tail_table, thresholds_for_job
from mechmon_megatron.detect.phase_moments import TrainingSchedule, select_phase_table
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


YOUNG_INTERVAL, YOUNG_DELTA = 20, 100
"""The schedule the shipped phase moments were measured at."""
CALIBRATION_SCHEDULE = TrainingSchedule(100, "cosine", 2e-3)
"""The shipped calibration runs' learning-rate schedule."""
YOUNG_UNTIMED, YOUNG_TIMED = 10, 30
"""Checks fed before timing (the first steps have too few values for a residual), and timed."""


def young_us_per_check(checks: list[list[Observation]], layers: int, moe_layers: int) -> dict[str, float]:
    """Microseconds per check of the whole-job detector while baselines are young, without and with
    the shipped phase moments, on the same checks (from step ``YOUNG_DELTA``, every interval)."""
    table = load_tail_table()
    phase, line = select_phase_table(table.phase, YOUNG_INTERVAL, YOUNG_DELTA, CALIBRATION_SCHEDULE)
    if phase is None:
        raise SystemExit(f"the shipped calibration has no phase moments to time: {line}")
    shape = JobShape(layers={"attn_delta2": layers, "attn_dw": layers, "router_entropy": moe_layers,
                             "router_weights": moe_layers},
                     interval=YOUNG_INTERVAL, overlap=YOUNG_DELTA // YOUNG_INTERVAL)
    thresholds, _ = thresholds_for_job(shape, 0.01, table)
    window = min(default_sequential_config(YOUNG_INTERVAL).trend_of(f).window for f in shape.layers)
    if len(checks) >= window:  # every baseline must stay young through the timed checks
        raise SystemExit(f"{len(checks)} young checks fill a baseline window of {window}")
    out = {}
    for name, moments in (("uncorrected", None), ("phase_corrected", phase)):
        detector = PooledCusumDetector(thresholds, default_sequential_config(YOUNG_INTERVAL), phase=moments)
        steps = [YOUNG_DELTA + YOUNG_INTERVAL * i for i in range(len(checks))]
        for step, obs in zip(steps[:YOUNG_UNTIMED], checks[:YOUNG_UNTIMED]):
            detector.update(step, obs)
        timed = list(zip(steps[YOUNG_UNTIMED:], checks[YOUNG_UNTIMED:]))
        start = time.perf_counter()
        for step, obs in timed:
            detector.update(step, obs)
        out[name] = 1e6 * (time.perf_counter() - start) / len(timed)
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
    young_checks = [synthetic_check(i, args.layers, args.heads, args.moe_layers, rng)
                    for i in range(1, YOUNG_UNTIMED + YOUNG_TIMED + 1)]
    young = young_us_per_check(young_checks, args.layers, args.moe_layers)
    result = {
        "streams_per_check": len(checks[0]),
        "young_us_per_check": young,
        "ratio_young_corrected_to_uncorrected": young["phase_corrected"] / young["uncorrected"],
        "us_per_check": timings,
        "ratio_pooled_to_per_stream": timings["pooled_cusum"] / timings["per_stream_0_1"],
        "us_per_stream_check": {k: v / len(checks[0]) for k, v in timings.items()},
        "shape": {"layers": args.layers, "heads": args.heads, "moe_layers": args.moe_layers},
    }
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
