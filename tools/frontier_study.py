"""The frontier-attention fault study (docs/METHOD.md section 8b): train, then report.

    python tools/detector_study.py run --plan frontier-mla --out runs/frontier_mla --jobs 2      # resumable
    python tools/frontier_study.py runs/frontier_mla --variant mla --json /tmp/frontier_mla.json
    python tools/detector_study.py export --plan frontier-mla --out runs/frontier_mla --to docs/data/frontier_mla
    python tools/frontier_study.py docs/data/frontier_mla --variant mla                            # no training

Prints the markdown of docs/RESULTS.md, "Frontier attention" (the shipped detector on the
variant's healthy and fault runs; for MLA also the whole stream, secondary). Runs still training
are reported with the steps they have (the table says which are unfinished).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.research.study.frontier_plan import FRONTIER_VARIANTS
from mechmon_megatron.research.study.frontier_report import frontier_report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="A campaign folder (with runs/) or an exported records folder.")
    p.add_argument("--variant", required=True, choices=sorted(FRONTIER_VARIANTS))
    p.add_argument("--rate", type=float, default=DEFAULT_FALSE_ALARM_RATE, help="False alarms per 10^6 steps.")
    p.add_argument("--json", default=None, help="Also write the report's numbers here.")
    args = p.parse_args(argv)
    if not os.path.isdir(args.path):
        print(f"no such folder {args.path!r}", file=sys.stderr)
        return 2
    text, data = frontier_report(args.path, args.variant, args.rate)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
