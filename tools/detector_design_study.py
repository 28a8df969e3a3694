"""Design study on the committed records (no training): CUSUM vs CUSUM + Shewhart limit, and the
research-only attention-logit family, at the session default false-alarm rate.

    python tools/detector_design_study.py --records docs/data/detector_study --out /tmp/design_study.json

Prints the markdown tables of docs/RESULTS.md ("Designs evaluated and not adopted") and writes
the full JSON (per run, interval and design: first alarms by family, kinds, leads, every alarm).
A few minutes on 2 cores. See ``mechmon_megatron.research.study.design_study``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.design_study import markdown, run_study

_RECORDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "data", "detector_study")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", default=_RECORDS, help="Exported study records (default: docs/data/detector_study).")
    p.add_argument("--out", default=None, help="Where to write the JSON results (default: not written).")
    p.add_argument("--rate", type=float, default=DEFAULT_FALSE_ALARM_RATE,
                   help="False alarms per 10^6 steps for the whole job (default: the session default).")
    args = p.parse_args(argv)
    if not os.path.isdir(args.records):
        print(f"--records: no such directory {args.records!r}", file=sys.stderr)
        return 2
    results = run_study(load_records(args.records), rate=args.rate)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
