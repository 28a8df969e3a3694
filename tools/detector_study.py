"""Detector calibration study: long healthy runs and the fault grid, then the analysis.

    python tools/detector_study.py run --out runs/detector_study --jobs 2   # hours on 2 cores; resumable
    python tools/detector_study.py analyze --out runs/detector_study         # tables, plots, JSON
    python tools/detector_study.py export --out runs/detector_study --to docs/data/detector_study
    python tools/detector_study.py analyze --out /tmp/ds --records docs/data/detector_study  # no training
    python tools/detector_study.py run --plan frontier-mla --out runs/frontier_mla --jobs 2
    python tools/detector_study.py run --plan early-phase --out runs/early_phase --jobs 2  # held out
    python tools/detector_study.py run --plan early-phase-lr --out runs/early_phase_lr --jobs 2

``run`` trains (or resumes) every run of ``mechmon_megatron.research.study.long_plan``; launch it again
after an interruption and it continues from the checkpoints. See docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional

from mechmon_megatron.research.study.campaign import launch_campaign
from mechmon_megatron.research.study.early_phase_plan import (
    plan_early_phase_campaign,
    plan_learning_rate_campaign,
    write_provisional_calibration,
)
from mechmon_megatron.research.study.frontier_plan import FRONTIER_VARIANTS, plan_frontier_campaign
from mechmon_megatron.research.study.long_plan import CampaignRun, plan_campaign

PLANS = ("study", *(f"frontier-{v}" for v in FRONTIER_VARIANTS), "early-phase", "early-phase-lr")


def _plan(name: str, out: str) -> list[CampaignRun]:
    if name == "early-phase":
        return plan_early_phase_campaign(write_provisional_calibration(out))
    if name == "early-phase-lr":
        return plan_learning_rate_campaign(write_provisional_calibration(out))
    if name.startswith("frontier-"):
        return plan_frontier_campaign(name.removeprefix("frontier-"))
    return plan_campaign()


def _only(runs: list[CampaignRun], only: Optional[str]) -> list[CampaignRun]:
    """The runs named by ``--only`` (all of them without it); SystemExit naming unknown ids."""
    if not only:
        return runs
    wanted = {x.strip() for x in only.split(",")}
    unknown = wanted - {r.run_id for r in runs}
    if unknown:
        raise SystemExit(f"--only: unknown run ids {sorted(unknown)}; choose from {[r.run_id for r in runs]}")
    return [r for r in runs if r.run_id in wanted]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="Train or resume every run of the campaign.")
    run.add_argument("--out", required=True, help="Campaign directory.")
    run.add_argument("--jobs", type=int, default=2, help="Runs in parallel (one core each).")
    run.add_argument("--only", default=None, help="Comma-separated run ids (default: all).")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--plan", choices=PLANS, default="study",
                     help="study: the detector study (long_plan); frontier-mla / frontier-qknorm: its grid on "
                     "multi-head latent attention / QK-norm (frontier_plan); early-phase: the held-out runs of "
                     "the early-phase study (early_phase_plan, docs/METHOD.md section 8c); early-phase-lr: its second "
                     "held-out set, learning-rate faults on seeds 22-27.")
    analyze = sub.add_parser("analyze", help="Calibrate the detector and compare rules at equal false-alarm rate.")
    analyze.add_argument("--out", required=True, help="Campaign directory (outputs go to OUT/analysis).")
    analyze.add_argument("--records", default=None,
                         help="Analyse exported records instead of the runs (e.g. docs/data/detector_study).")
    analyze.add_argument("--no-plots", action="store_true")
    export = sub.add_parser("export", help="Write the runs' records (no checkpoints), one .json.gz per run.")
    export.add_argument("--out", required=True, help="Campaign directory.")
    export.add_argument("--to", required=True, help="Destination folder (e.g. docs/data/detector_study).")
    export.add_argument("--plan", choices=PLANS, default="study", help="As for run.")
    export.add_argument("--only", default=None, help="Comma-separated run ids (default: every run that exists).")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "run":
        runs = _only(_plan(args.plan, args.out), args.only)
        status = launch_campaign(runs, args.out, jobs=args.jobs, progress=not args.no_progress)
        print(json.dumps({k: v.get("state") for k, v in status.items()}, indent=1))
        return 0 if all(v.get("state") in ("done", "stopped-after-divergence") for v in status.values()) else 1
    if args.command == "export":
        from mechmon_megatron.research.study.campaign_records import export_records

        paths = export_records(args.out, args.to, _only(_plan(args.plan, args.out), args.only))
        print(json.dumps({"files": len(paths), "bytes": sum(os.path.getsize(p) for p in paths)}))
        return 0
    from mechmon_megatron.research.study.detector_report import analyze_campaign

    analysis_dir = os.path.join(args.out, "analysis")
    analyze_campaign(args.out, plots=not args.no_plots, records_dir=args.records, analysis_dir=analysis_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
