"""Fit the detector's null tails on your own healthy runs (the shipped default came from ours).

    python tools/calibrate_detector.py RUN_DIR [RUN_DIR ...] --interval 20 --delta 100 --out null_tails.json \\
        [--leave-one-out]

Each RUN_DIR holds ``mechmon/mechmon_scalars.jsonl`` (or is that file, or a record exported by
``tools/detector_study.py export``) of a healthy run recorded with ``--mechmon-per-head-scalars``;
a records file that holds several fresh starts into one log dir gives one series per run (``#runK``
in the names; a resume continues its run).
The runs are replayed without alarms, the CUSUM values of every test are collected and their
exponential tails fitted (``mechmon_megatron.detect.null_model``), and so are the per-check pooled
residuals (the ``shewhart`` section that ``--mechmon-detector-shewhart`` needs).
Use the file with ``--mechmon-detector-calibration FILE`` (DeepSpeed: ``detector_calibration``).
``--leave-one-out`` (three runs or more) also fits on all runs but one and replays the detector at
``--rate`` on the one left out, for each run and both schedules the file serves: a held-out alarm
is a false alarm that this calibration would not have prevented, and the closest approach to a
warning level says how much room the quiet runs had (``research/study/calibration_check.py``).
Prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.research.study.calibration_check import leave_one_run_out, replays_needed, summary
from mechmon_megatron.research.study.campaign_data import load_named_runs
from mechmon_megatron.research.study.pooled_replay import calibrate_on_runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="Healthy run directories (or mechmon_scalars.jsonl files).")
    p.add_argument("--interval", type=int, required=True, help="--mechmon-interval the runs were recorded with.")
    p.add_argument("--delta", type=int, required=True, help="--mechmon-delta the runs were recorded with.")
    p.add_argument("--out", default=None, help="Where to write the tail table (JSON); default: print only.")
    p.add_argument("--leave-one-out", action="store_true",
                   help="Also replay each run with the tails of the others (needs at least 3 runs).")
    p.add_argument("--rate", type=float, default=DEFAULT_FALSE_ALARM_RATE,
                   help="False alarms per 10^6 steps for --leave-one-out (the session default).")
    args = p.parse_args(argv)
    if args.leave_one_out and len(args.runs) < 3:
        p.error(f"--leave-one-out needs at least 3 healthy runs (2 to fit, 1 to hold out), got {len(args.runs)}")
    try:
        series, names = load_named_runs(args.runs, _name)  # a file of several fresh starts: one series each
        table, log = calibrate_on_runs(
            series,
            args.interval,
            args.delta,
            source=f"{len(series)} healthy runs, interval {args.interval}, delta {args.delta}",
            shewhart=True,
        )
    except (OSError, ValueError) as exc:
        raise SystemExit(f"calibration failed: {exc}") from None
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(table.to_dict(), f, indent=1)
            f.write("\n")
    result = {"out": args.out, "runs": len(series), "checks": sum(len(s) for s in series), "fit": log}
    if args.leave_one_out:
        bar = _progress_bar(replays_needed(len(series), args.interval, args.delta))
        try:
            held = leave_one_run_out(series, names, args.interval, args.delta, args.rate,
                                     on_replay=bar.update if bar is not None else None)
        except ValueError as exc:
            raise SystemExit(f"--leave-one-out failed: {exc}") from None
        finally:
            if bar is not None:
                bar.close()
        result["leave_one_out"] = {"rate": args.rate, "summary": summary(held),
                                   "runs": [asdict(h) for h in held]}
    print(json.dumps(result, indent=1))
    return 0


def _progress_bar(total: int):
    """A tqdm bar of the leave-one-out replays on stderr when it is a terminal (never in logs or
    pipes), else None; None as well without tqdm (it is in the ``test`` extra)."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="replay", desc="leave-one-out", file=sys.stderr, dynamic_ncols=True)


def _name(path: str) -> str:
    """A run's name in the output: its folder, or its record's file name without ``.json.gz``."""
    base = os.path.basename(os.path.normpath(path))
    if base == "mechmon_scalars.jsonl":
        base = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(path))))
    return base.removesuffix(".json.gz")


if __name__ == "__main__":
    sys.exit(main())
