"""The shipped detector (``null_tails.json``, ``--mechmon-false-alarm-rate``) replayed on recorded
healthy runs at intervals 20 and 100: alarms, and each run's closest approach to a warning level.
No training; about a minute for the eight 10,000-step healthy runs:

    python tools/replay_shipped_detector.py docs/data/detector_study docs/data/short_window_study \\
        --runs healthy-cosine-seed1,healthy-cosine-seed2,healthy-cosine-seed3,healthy-cosine-seed5,\\
healthy-wsd-seed4,healthy-cosine-seed10,healthy-cosine-seed11,healthy-cosine-seed12 --json /tmp/shipped.json

A run id found in several folders is taken from the first. Prints the markdown table of
docs/RESULTS.md, "Healthy runs". See ``mechmon_megatron/research/study/shipped_replay.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.shipped_replay import markdown, replay_shipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", help="Record folders (tools/detector_study.py export).")
    p.add_argument("--runs", default=None, help="Comma-separated healthy run ids (default: every healthy run).")
    p.add_argument("--intervals", default="20,100", help="Check intervals to replay (multiples of 20).")
    p.add_argument("--rate", type=float, default=DEFAULT_FALSE_ALARM_RATE, help="False alarms per 10^6 steps.")
    p.add_argument("--json", default=None, help="Write the replays here.")
    args = p.parse_args(argv)
    records = {}
    for folder in args.records:
        if not os.path.isdir(folder):
            print(f"no such records folder {folder!r}", file=sys.stderr)
            return 2
        for run_id, record in load_records(folder).items():
            records.setdefault(run_id, record)
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


if __name__ == "__main__":
    sys.exit(main())
