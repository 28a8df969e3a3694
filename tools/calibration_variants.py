"""Leave-one-run-out under variants of the null-tail fit (issue 19; research, no training):
the shipped fit, a declustered confidence bound, and a fit consistent with the warning level's
baseline freeze (``mechmon_megatron.research.study.calibration_variants``).

    python tools/calibration_variants.py RUN... --interval 20 --delta 100 [--variants shipped,declustered]

RUN: healthy run directories, ``mechmon_scalars.jsonl`` files or exported records (``*.json.gz``).
Prints a markdown table (held-out runs with a false alarm, per variant and schedule); ``--out``
writes the alarms as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.research.study.calibration_variants import VARIANTS, as_json, compare_variants, markdown
from mechmon_megatron.research.study.campaign_data import load_named_runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="Healthy runs (at least 3).")
    p.add_argument("--interval", type=int, required=True, help="--mechmon-interval the runs were recorded with.")
    p.add_argument("--delta", type=int, required=True, help="--mechmon-delta the runs were recorded with.")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma-separated, of {', '.join(VARIANTS)}.")
    p.add_argument("--iterations", type=int, default=2, help="Refits of the warning-freeze variant (default 2).")
    p.add_argument("--rate", type=float, default=DEFAULT_FALSE_ALARM_RATE, help="False alarms per 10^6 steps.")
    p.add_argument("--out", default=None, help="Write the held-out alarms as JSON here.")
    args = p.parse_args(argv)
    if len(args.runs) < 3:
        p.error(f"needs at least 3 healthy runs (2 to fit, 1 to hold out), got {len(args.runs)}")
    try:
        series, names = load_named_runs(  # a file of several fresh starts: one series each
            args.runs, lambda r: os.path.basename(os.path.normpath(r)).removesuffix(".json.gz"))
        results = compare_variants(series, names, args.interval, args.delta, args.rate,
                                   [v for v in args.variants.split(",") if v], args.iterations)
    except (OSError, ValueError) as exc:
        print(f"calibration_variants: {exc}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(as_json(results), f, indent=1)
            f.write("\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
