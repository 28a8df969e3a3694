"""Issue 19, round 6: ``long`` vs ``long+logit`` (a per-step attention logit growth test) at the
same false-alarm rate, on the short-window campaign's records (no training; about a minute):

    python tools/logit_step_study.py --records docs/data/short_window_study --out /tmp/logit_step.json

Prints the tables of docs/RESULTS.md, "Attention logit growth read every step".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.logit_step_study import markdown, run_logit_step_study
from mechmon_megatron.research.study.short_window_study import logit_rule_threshold

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", default=os.path.join(ROOT, "docs", "data", "short_window_study"))
    p.add_argument("--study-records", default=os.path.join(ROOT, "docs", "data", "detector_study"),
                   help="The round-2 records: they fix the max-logit rule's threshold and give three "
                   "held-out 10,000-step healthy runs.")
    p.add_argument("--out", default=None, help="Write the results as JSON here.")
    args = p.parse_args(argv)
    for path in (args.records, args.study_records):
        if not os.path.isdir(path):
            print(f"no such records directory {path!r}", file=sys.stderr)
            return 2
    study = load_records(args.study_records)
    extra = {k: v for k, v in study.items() if v.healthy and k not in ("healthy-cosine-seed1", "healthy-cosine-seed2")}
    results = run_logit_step_study(load_records(args.records), logit_rule_threshold(study), extra_healthy=extra)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
