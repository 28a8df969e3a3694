"""Fit the detector's null tails on your own healthy runs (the shipped default came from ours).

    python tools/calibrate_detector.py RUN_DIR [RUN_DIR ...] --interval 20 --delta 100 --out null_tails.json

Each RUN_DIR holds ``mechmon/mechmon_scalars.jsonl`` (or is that file) of a healthy run recorded
with ``--mechmon-per-head-scalars``. The runs are replayed without alarms, the CUSUM values of
every test are collected and their exponential tails fitted (``mechmon_megatron.detect.null_model``),
and so are the per-check pooled residuals (the ``shewhart`` section that
``--mechmon-detector-shewhart`` needs).
Use the file with ``--mechmon-detector-calibration FILE`` (DeepSpeed: ``detector_calibration``).
Prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys

from mechmon_megatron.research.study.campaign_data import load_checks
from mechmon_megatron.research.study.pooled_replay import calibrate_on_runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="Healthy run directories (or mechmon_scalars.jsonl files).")
    p.add_argument("--interval", type=int, required=True, help="--mechmon-interval the runs were recorded with.")
    p.add_argument("--delta", type=int, required=True, help="--mechmon-delta the runs were recorded with.")
    p.add_argument("--out", default=None, help="Where to write the tail table (JSON); default: print only.")
    args = p.parse_args(argv)
    try:
        series = [load_checks(r) for r in args.runs]
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
    print(
        json.dumps({"out": args.out, "runs": len(series), "checks": sum(len(s) for s in series), "fit": log}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
