"""Training time with mechmon off vs on, in one process: prints one JSON object.

    python tools/bench_overhead.py --train-iters 400 --repeats 2 [--mechmon-interval 100] [-- trainer flags]

Both arms run the same example trainer (examples/pretrain_scripts) with the same seed and data,
alternating off/on ``--repeats`` times in this one process (after one untimed warm-up run) so
machine noise hits both; the loop time from the end of iteration 1 to the end of the last
iteration (every step's forward, backward, optimizer and callbacks; start-up excluded) is compared. ``overhead_ratio`` =
median(on) / median(off) - 1. The session's own accounting (``mechmon/overhead_ms`` summed over
checks) is reported too: it excludes the router-logit capture on check steps, which the A/B
difference includes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile

DEMO_MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
              "--micro-batch-size", "4", "--global-batch-size", "4", "--num-experts", "4", "--moe-router-topk", "2",
              "--lr", "1e-3", "--log-interval", "1000000"]


def _train_seconds(trainer_args: list[str], metrics_path: str) -> float:
    """Run one training in this process; return its loop wall time in seconds."""
    from gpt_trainer import main
    from mechmon_megatron.adapters.megatron_core import MechmonCallback
    from mechmon_megatron.cli.args import add_mechmon_args, config_from_args

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    main([*trainer_args, "--metrics-jsonl", metrics_path], [add_mechmon_args],
         callbacks_factory=lambda a: [MechmonCallback(config_from_args(a))])
    rows = [json.loads(line) for line in open(metrics_path, encoding="utf-8")]
    # Metrics rows are written before on_step_end, so row[k+1] - row[k] spans step k's callbacks.
    return rows[-1]["wall_time"] - rows[0]["wall_time"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-iters", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mechmon-interval", type=int, default=100)
    parser.add_argument("--mechmon-delta", type=int, default=100)
    parser.add_argument("trainer_args", nargs="*", help="extra trainer flags (after --)")
    args = parser.parse_args(argv)
    base = [*DEMO_MODEL, *args.trainer_args, "--train-iters", str(args.train_iters)]
    results: dict[str, list[float]] = {"off": [], "on": []}
    session_ms: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        _train_seconds([*DEMO_MODEL, "--train-iters", "3"], os.path.join(tmp, "warmup.jsonl"))
        for r in range(args.repeats):
            for arm in ("off", "on"):
                extra = []
                log_dir = os.path.join(tmp, f"{arm}{r}")
                if arm == "on":
                    extra = ["--mechmon", "--mechmon-interval", str(args.mechmon_interval),
                             "--mechmon-delta", str(args.mechmon_delta), "--mechmon-log-dir", log_dir]
                total = _train_seconds([*base, *extra], os.path.join(tmp, f"{arm}{r}.jsonl"))
                results[arm].append(total)
                if arm == "on":
                    rows = [json.loads(line) for line in open(os.path.join(log_dir, "mechmon_scalars.jsonl"))]
                    session_ms.append(sum(row["scalars"].get("mechmon/overhead_ms", 0.0) for row in rows))
    import torch

    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    report = {
        "config": {"trainer_args": base, "mechmon_interval": args.mechmon_interval, "mechmon_delta": args.mechmon_delta,
                   "repeats": args.repeats},
        "wall_s": results,
        "overhead_ratio": on / off - 1.0,
        "session_ms_total": session_ms,
        "session_share_of_off": statistics.median(session_ms) / 1000.0 / off if session_ms else None,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "note": "wall_s: loop time from the end of iteration 1 to the end of the last iteration",
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
