"""Expected false alarms of a frontier job, extrapolated from recorded healthy runs.

    python tools/frontier_false_alarms.py RUN_DIR [RUN_DIR ...] --interval 20 --delta 100 \\
        [--layers 80 --heads 64 --query-groups 8 --moe-layers 60 --experts 64 --checks 10000 \\
         --job-interval 100 --rate 0.01] [--json]

Method (docs/RESULTS.md, "Frontier extrapolation"):

1. Replay the detector on the healthy runs with the job's schedule (``--job-interval`` =
   ``--delta``: the recorded checks are subsampled to it) and fit the exponential null tail of
   every test's CUSUM (``detect.null_model``).
2. Set the thresholds the session would set for the frontier job at ``--rate``: a union bound
   over its tests (per family one CUSUM per layer plus the pooled family CUSUM) and its checks.
3. Expected false alarms over the job = sum over tests and checks of the fitted ``P0(S > h)``,
   with the rate's lower confidence bound (what the thresholds use) and with the point estimate.
4. Check the tail model where data exist: leave one healthy run out, fit on the others, and
   compare predicted and observed counts of checks with ``S > h`` on the held-out run over a
   ladder of ``h``.
5. For contrast, the per-stream rule of mechmon 0.1 (median/MAD band, 6 MADs, 5 %, patience 3,
   one detector per head stream): its alarms per stream-check on the same healthy runs, scaled
   to the job's stream-checks.

Assumptions, stated in the output: the proxy's healthy null holds per layer at frontier scale
(pooling over 64 heads and 80 layers instead of 4 only lowers the variance of the pooled
statistic, so this errs towards too many false alarms if head residuals are no more correlated
than here); the union bound (conservative); the exponential tail beyond the data.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, JobShape, thresholds_for_job
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.study.campaign_data import load_runs
from mechmon_megatron.research.study.per_stream_rule import feed_per_stream, per_stream_bank
from mechmon_megatron.research.study.pooled_replay import fit_tail_table, null_statistics, subsample
from mechmon_megatron.session.detector_inputs import observations_from_scalars


def expected_false_alarms(shape: JobShape, thresholds, table, checks: int, point_estimate: bool = False) -> float:
    total = 0.0
    for family, layers in shape.layers.items():
        for level, count in (("layer", layers), ("family", 1 if layers > 1 else 0)):
            if not count:
                continue
            tail, _ = table.tail(shape.overlap, family, level)
            h = getattr(thresholds[family], level).alarm
            theta = tail.theta_hat if point_estimate else tail.theta
            total += count * checks * math.exp(tail.log_p_u0 - theta * max(0.0, h - tail.u0))
    return total


def leave_one_out(series, interval, every) -> list[dict]:
    """Predicted vs observed exceedance counts of the layer CUSUM on each held-out run."""
    config = default_sequential_config(interval * every)
    rows = []
    for i in range(len(series)):
        train = [subsample(s, interval, every) for j, s in enumerate(series) if j != i]
        held = subsample(series[i], interval, every)
        table, _ = fit_tail_table({1: (interval * every, train)})
        stats = null_statistics([held], config)
        for family, levels in stats.items():
            values = levels["layer"]
            if not values:
                continue
            tail, _ = table.tail(1, family, "layer")
            for h in (tail.u0 + 2.0 / tail.theta_hat, tail.u0 + 4.0 / tail.theta_hat, tail.u0 + 6.0 / tail.theta_hat):
                rows.append(
                    {
                        "held_out": i,
                        "family": family,
                        "h": h,
                        "checks": len(values),
                        "predicted": len(values) * math.exp(tail.log_p_u0 - tail.theta_hat * (h - tail.u0)),
                        "predicted_cautious": len(values) * math.exp(tail.log_survival(h)),
                        "observed": sum(1 for v in values if v > h),
                    }
                )
    return rows


def old_rule_rate(series) -> dict:
    """Alarms of the 0.1 per-stream rule (session defaults) per stream-check on healthy runs."""
    fired = stream_checks = 0
    for checks in series:
        bank = per_stream_bank()
        for step, scalars in checks:
            events = feed_per_stream(bank, step, observations_from_scalars(scalars))
            stream_checks += len(events)
            fired += sum(1 for e in events if e.fired)
    return {
        "alarms": fired,
        "stream_checks": stream_checks,
        "per_stream_check": fired / stream_checks if stream_checks else None,
        "upper_95_per_stream_check": (3.0 if fired == 0 else fired + 2.0 * math.sqrt(fired)) / max(1, stream_checks),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="Healthy run directories (recorded with --mechmon-per-head-scalars).")
    p.add_argument("--interval", type=int, required=True, help="Check interval of the recorded runs.")
    p.add_argument("--delta", type=int, required=True, help="Increment window of the recorded runs.")
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--heads", type=int, default=64, help="Query heads per layer.")
    p.add_argument("--query-groups", type=int, default=8)
    p.add_argument("--moe-layers", type=int, default=60)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--checks", type=int, default=10_000, help="Checks over the job (1,000,000 steps at interval 100).")
    p.add_argument("--job-interval", type=int, default=None, help="The job's check interval (default: --delta).")
    p.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_FALSE_ALARM_RATE,
        help="--mechmon-false-alarm-rate of the job (per 10^6 steps).",
    )
    p.add_argument("--json", action="store_true", help="Print only the JSON object.")
    args = p.parse_args(argv)
    job_interval = args.job_interval or args.delta
    if job_interval % args.interval:
        raise SystemExit(f"--job-interval {job_interval} must be a multiple of the recorded --interval {args.interval}")
    every = job_interval // args.interval
    overlap = max(1, math.ceil(args.delta / job_interval))
    series = [run for r in args.runs for run in load_runs(r)]  # a file of several fresh starts: one series each
    table, fit = fit_tail_table(
        {overlap: (job_interval, [subsample(s, args.interval, every) for s in series])}, source="frontier extrapolation"
    )
    shape = JobShape(
        layers={
            "attn_delta2": args.layers,
            "attn_dw": args.layers,
            "router_entropy": args.moe_layers,
            "router_weights": args.moe_layers,
        },
        interval=job_interval,
        overlap=overlap,
    )
    thresholds, account = thresholds_for_job(shape, args.rate, table)
    steps = args.checks * job_interval
    stream_checks = args.checks * (args.layers * args.heads + 2 * args.layers + 2 * args.moe_layers)
    old = old_rule_rate(series)
    result = {
        "job": {
            "layers": args.layers,
            "query_heads": args.heads,
            "query_groups": args.query_groups,
            "moe_layers": args.moe_layers,
            "experts": args.experts,
            "checks": args.checks,
            "interval": job_interval,
            "steps": steps,
            "tests": shape.num_tests(),
            "stream_checks": stream_checks,
        },
        "rate_per_million_steps": args.rate,
        "expected_false_alarms": expected_false_alarms(shape, thresholds, table, args.checks),
        "expected_false_alarms_point_estimate": expected_false_alarms(shape, thresholds, table, args.checks, True),
        "expected_false_alarms_per_million_steps": expected_false_alarms(shape, thresholds, table, args.checks)
        * 1e6
        / steps,
        "thresholds": account.to_dict()["thresholds"],
        "fit": fit,
        "tail_check_leave_one_out": leave_one_out(series, args.interval, every),
        "old_per_stream_rule": {
            **old,
            "expected_false_alarms_at_job_scale": (old["per_stream_check"] or 0) * stream_checks,
            "upper_95_at_job_scale": old["upper_95_per_stream_check"] * stream_checks,
        },
        "healthy_runs": len(series),
        "assumptions": [
            "the healthy null of each test's CUSUM, measured on the proxy, holds per layer at frontier scale "
            "(pooling more heads/layers lowers the pooled variance: errs towards more false alarms)",
            "union bound over tests and checks (errs towards more false alarms)",
            "exponential tail beyond the data, with theta at its 95 % lower confidence bound",
        ],
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("fit", "tail_check_leave_one_out", "thresholds")}, indent=1
        )
    )
    print("\nleave-one-out tail check (layer CUSUM, predicted with the point estimate / cautious fit vs observed):")
    for row in result["tail_check_leave_one_out"]:
        print(
            f"  run {row['held_out']} {row['family']:15s} h={row['h']:7.2f}: predicted {row['predicted']:7.2f} "
            f"(cautious {row['predicted_cautious']:7.2f}) observed {row['observed']:4d} of {row['checks']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
