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

``--persistence`` (issue 19, round 8): the same comparison with the persistence of Delta2's
leading direction as the added family (``mechmon_megatron.research.study.persistence_study``);
``--more-records`` adds exported records of other campaigns (the held-out healthy seeds 13-15),
``--runs`` replays only the named runs (the calibration runs are always fitted):

    python tools/detector_design_study.py --persistence --records docs/data/short_window_study \
        --more-records docs/data/healthy_check_study

``--candidates`` (issue 19): delay against false-alarm rate of those candidate families beside the
shipped ones and the symptom rules (``mechmon_megatron.research.study.candidate_sweeps``): a table
of median delays at zero observed healthy alarms, and with ``--plots DIR`` one PNG per fault group:

    python tools/detector_design_study.py --candidates --records docs/data/short_window_study \
        --more-records docs/data/healthy_check_study --plots docs/img/detector
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
    p.add_argument("--persistence", action="store_true",
                   help="Like --short-window, with the persistence of Delta2's leading direction as the added family.")
    p.add_argument("--more-records", action="append", default=[], metavar="DIR",
                   help="With --short-window / --persistence / --candidates: more exported records (repeatable).")
    p.add_argument("--runs", default=None,
                   help="With --short-window / --persistence: replay only these run ids (comma-separated); the "
                   "calibration runs are always loaded.")
    p.add_argument("--candidates", action="store_true",
                   help="Delay vs false-alarm rate of the candidate families (short window, persistence).")
    p.add_argument("--plots", default=None, metavar="DIR", help="With --candidates: write the PNGs here.")
    args = p.parse_args(argv)
    for flag, path in [("--records", args.records)] + [("--more-records", d) for d in args.more_records]:
        if not os.path.isdir(path):
            print(f"{flag}: no such directory {path!r}", file=sys.stderr)
            return 2
    if args.candidates:
        return _candidates(args)
    if args.short_window or args.persistence:
        return _short_window(args)
    results = run_study(load_records(args.records), rate=args.rate)
    _write_json(args.out, results)
    print(markdown(results))
    return 0


def _short_window(args: argparse.Namespace) -> int:
    from mechmon_megatron.research.study import persistence_study
    from mechmon_megatron.research.study.campaign_data import load_campaign
    from mechmon_megatron.research.study.detector_report import CALIBRATION_RUNS
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
    records = _with_more_records(records, args.more_records)
    if args.runs:
        wanted = [r for r in args.runs.split(",") if r]
        unknown = [r for r in wanted if r not in records]
        if unknown:
            print(f"--runs: not in the records: {', '.join(unknown)}", file=sys.stderr)
            return 2
        records = {r: rec for r, rec in records.items() if r in wanted or r in CALIBRATION_RUNS}
    threshold = logit_rule_threshold(load_records(args.study_records))
    study = persistence_study.run_persistence_study if args.persistence else run_short_window_study
    render = persistence_study.markdown if args.persistence else short_markdown
    try:
        results = study(records, rate=args.rate, logit_threshold=threshold)
    except ValueError as exc:
        print(f"--records {args.records}: {exc}", file=sys.stderr)
        return 2
    _write_json(args.out, results)
    held_out = persistence_study.HELD_OUT_SEEDS if args.persistence else HELD_OUT_SEEDS
    print(render(results, held_out_seeds=held_out))
    return 0


def _candidates(args: argparse.Namespace) -> int:
    from mechmon_megatron.research.study import candidate_sweeps

    records = _with_more_records(load_records(args.records), args.more_records)
    try:
        results = candidate_sweeps.candidate_sweeps(records)
    except ValueError as exc:
        print(f"--records {args.records}: {exc}", file=sys.stderr)
        return 2
    _write_json(args.out, results)
    if args.plots:
        from mechmon_megatron.research.study.detector_plots import plot_delay_vs_far

        for path in plot_delay_vs_far(results, args.plots, rules=candidate_sweeps.CURVES, prefix="candidates"):
            print(f"wrote {path}", file=sys.stderr)
    print(candidate_sweeps.markdown(results))
    return 0


def _with_more_records(records: dict, more: list[str]) -> dict:
    """``records`` with the exported records of every folder of ``--more-records`` added."""
    for directory in more:
        records.update(load_records(directory))
    return records


def _write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
