"""The shipped detector (``null_tails.json``, ``--mechmon-false-alarm-rate``) replayed on recorded
healthy runs at intervals 20 and 100: alarms, and each run's closest approach to a warning level.
No training; about a minute for the eight 10,000-step healthy runs:

    python tools/replay_shipped_detector.py docs/data/detector_study docs/data/short_window_study \\
        --runs healthy-cosine-seed1,healthy-cosine-seed2,healthy-cosine-seed3,healthy-cosine-seed5,\\
healthy-wsd-seed4,healthy-cosine-seed10,healthy-cosine-seed11,healthy-cosine-seed12 --json /tmp/shipped.json

A run id found in several folders is taken from the first. Prints the markdown table of
docs/RESULTS.md, "Healthy runs". ``--faults RUN_IDS`` prints instead the fault runs' table (first
alarms at interval 20 beside the max-logit rule at its most sensitive threshold quiet on every
healthy run of the FIRST folder; docs/RESULTS.md, "Fault runs at the session default"):

    python tools/replay_shipped_detector.py docs/data/detector_study docs/data/short_window_study \
        --faults fa-s32-on500-seed10,fa-s16-on500-seed10,...

See ``mechmon_megatron/research/study/shipped_replay.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.shipped_replay import (
    fault_markdown,
    fault_row,
    logit_rule_threshold,
    markdown,
    replay_shipped,
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", help="Record folders (tools/detector_study.py export).")
    p.add_argument("--runs", default=None, help="Comma-separated healthy run ids (default: every healthy run).")
    p.add_argument("--intervals", default="20,100", help="Check intervals to replay (multiples of 20).")
    p.add_argument("--rate", type=float, default=DEFAULT_FALSE_ALARM_RATE, help="False alarms per 10^6 steps.")
    p.add_argument("--faults", default=None, help="Comma-separated fault run ids: print their table instead.")
    p.add_argument("--json", default=None, help="Write the replays here.")
    args = p.parse_args(argv)
    records = {}
    first_folder = None
    for folder in args.records:
        if not os.path.isdir(folder):
            print(f"no such records folder {folder!r}", file=sys.stderr)
            return 2
        loaded = load_records(folder)
        first_folder = loaded if first_folder is None else first_folder
        for run_id, record in loaded.items():
            records.setdefault(run_id, record)
    if args.faults:
        return _faults(args, records, first_folder)
    healthy = sorted(k for k, r in records.items() if r.healthy)
    names = [x.strip() for x in args.runs.split(",")] if args.runs else healthy
    unknown = [n for n in names if n not in records]
    faults = [n for n in names if n in records and not records[n].healthy]
    if unknown or faults:
        print(f"--runs: {'no record for ' + str(unknown) if unknown else ''}"
              f"{' ' if unknown and faults else ''}{'not healthy: ' + str(faults) if faults else ''}", file=sys.stderr)
        return 2
    try:
        intervals = [int(x) for x in args.intervals.split(",")]
        replays = [replay_shipped(records[n], interval, args.rate) for interval in intervals for n in names]
    except ValueError as e:
        print(f"--intervals: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in replays], f, indent=1)
    print(markdown(replays))
    return 0


def _faults(args, records, first_folder) -> int:
    names = [x.strip() for x in args.faults.split(",") if x.strip()]
    bad = [n for n in names if n not in records or records[n].healthy]
    if bad:
        print(f"--faults: no fault record for {bad}", file=sys.stderr)
        return 2
    threshold = logit_rule_threshold(first_folder)
    rows = [fault_row(records[n], threshold, args.rate) for n in names]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"max_logit_rule_threshold": threshold, "runs": [asdict(r) for r in rows]}, f, indent=1)
    print(fault_markdown(rows, threshold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
