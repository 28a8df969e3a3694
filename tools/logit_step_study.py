"""Issue 19, round 6: ``long`` vs ``long+logit`` (a per-step attention logit growth test) at the
same false-alarm rate, on the short-window campaign's records (no training; about a minute):

    python tools/logit_step_study.py --records docs/data/short_window_study --out /tmp/logit_step.json

Prints the tables of docs/RESULTS.md, "Attention logit growth read every step". Round 7
(``long+logit5``: the per-step tail fitted on all five 10,000-step healthy runs, with its
leave-one-out check; docs/RESULTS.md, "Round 7"):

    python tools/logit_step_study.py --round7 --out /tmp/logit_step7.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.logit_step_study import (
    ROUND7_DESIGN,
    ROUND7_TAIL_RUNS,
    markdown,
    resolve_tail_records,
    run_logit_step_study,
)
from mechmon_megatron.research.study.short_window_study import logit_rule_threshold

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", default=os.path.join(ROOT, "docs", "data", "short_window_study"))
    p.add_argument("--study-records", default=os.path.join(ROOT, "docs", "data", "detector_study"),
                   help="The round-2 records: they fix the max-logit rule's threshold and give three "
                   "held-out 10,000-step healthy runs.")
    p.add_argument("--out", default=None, help="Write the results as JSON here.")
    p.add_argument("--logit-tail-runs", default=None,
                   help="Comma-separated healthy run ids whose per-step CUSUM fits the logit tail, looked up "
                   "in --records first, then in --study-records (default: the two calibration runs).")
    p.add_argument("--round7", action="store_true",
                   help=f"Round 7: --logit-tail-runs {','.join(ROUND7_TAIL_RUNS)}, design named {ROUND7_DESIGN}.")
    args = p.parse_args(argv)
    for path in (args.records, args.study_records):
        if not os.path.isdir(path):
            print(f"no such records directory {path!r}", file=sys.stderr)
            return 2
    study = load_records(args.study_records)
    records = load_records(args.records)
    extra = {k: v for k, v in study.items() if v.healthy and k not in ("healthy-cosine-seed1", "healthy-cosine-seed2")}
    names = list(ROUND7_TAIL_RUNS) if args.round7 else (
        [x.strip() for x in args.logit_tail_runs.split(",")] if args.logit_tail_runs else None)
    tail_records = None
    if names is not None:
        try:
            tail_records = resolve_tail_records(names, records, study)
        except (KeyError, ValueError) as e:
            print(f"--logit-tail-runs: {e}", file=sys.stderr)
            return 2
    design = ROUND7_DESIGN if args.round7 else "long+logit" if names is None else "long+logit (tail: named runs)"
    results = run_logit_step_study(records, logit_rule_threshold(study), extra_healthy=extra,
                                   logit_tail_records=tail_records, design=design)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
