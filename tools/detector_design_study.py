"""Issue 19 design study on the committed records (no training): CUSUM vs CUSUM + Shewhart limit,
and the research-only attention-logit family, at the session default false-alarm rate.

    python tools/detector_design_study.py --records docs/data/detector_study --out /tmp/design_study.json

Prints the markdown tables of docs/RESULTS.md ("Design study for a faster detector") and writes
the full JSON (per run, interval and design: first alarms by family, kinds, leads, every alarm).
A few minutes on 2 cores. See ``mechmon_megatron.research.study.design_study``.

``--short-window`` (issue 19): long CUSUM alone vs long + short windows at equal false-alarm rate
on the short-window campaign (``mechmon_megatron.research.study.short_window_study``), from its
exported records or straight from its campaign directory (runs still going included):

    python tools/detector_design_study.py --short-window --records ../detector_runs/short_window
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
    p.add_argument("--short-window", action="store_true",
                   help="The short-window study: --records is the short-window campaign directory or its export.")
    p.add_argument("--study-records", default=_RECORDS,
                   help="With --short-window: the detector study's records, which fix the max-logit rule's "
                   "threshold (default: docs/data/detector_study).")
    args = p.parse_args(argv)
    if not os.path.isdir(args.records):
        print(f"--records: no such directory {args.records!r}", file=sys.stderr)
        return 2
    if args.short_window:
        return _short_window(args)
    results = run_study(load_records(args.records), rate=args.rate)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    print(markdown(results))
    return 0


def _short_window(args: argparse.Namespace) -> int:
    from mechmon_megatron.research.study.campaign_data import load_campaign
    from mechmon_megatron.research.study.short_window_plan import HELD_OUT_SEEDS, plan_short_window_campaign
    from mechmon_megatron.research.study.short_window_study import (
        logit_rule_threshold,
        run_short_window_study,
    )
    from mechmon_megatron.research.study.short_window_study import (
        markdown as short_markdown,
    )

    if os.path.isdir(os.path.join(args.records, "runs")):  # a campaign directory: its runs as they are now
        plan = plan_short_window_campaign(os.path.join(os.path.abspath(args.records), "provisional_null_tails.json"))
        records = load_campaign(args.records, plan)
    else:
        records = load_records(args.records)
    threshold = logit_rule_threshold(load_records(args.study_records))
    try:
        results = run_short_window_study(records, rate=args.rate, logit_threshold=threshold)
    except ValueError as exc:
        print(f"--records {args.records}: {exc}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    print(short_markdown(results, held_out_seeds=HELD_OUT_SEEDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
