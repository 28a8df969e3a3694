"""Fault study: scenarios x seeds through the example megatron-core trainer, then the analysis.

    python tools/fault_study.py --scenarios clean,fa,moe-lr --seeds 1,2 --train-iters 1200 --out DIR

Writes DIR/results.json, DIR/report.md (table, orthogonality matrix, targets), DIR/plots/*.png and
one directory per run under DIR/runs/ (metrics, mechmon scalars, TensorBoard logs). See
docs/RESULTS.md for the definitions and the measured study.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from mechmon_megatron.research.study.report import markdown_report, markdown_sensitivity
from mechmon_megatron.research.study.scenarios import PRESETS, SCENARIO_NAMES, get_preset, get_scenario, with_overrides
from mechmon_megatron.research.study.study import StudyOptions, analyze_study, run_study, sensitivity


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="full", choices=sorted(PRESETS), help="Model size, run length, fault settings.")
    p.add_argument(
        "--scenarios", default=None, help=f"Comma-separated from {list(SCENARIO_NAMES)} (default: the preset's)."
    )
    p.add_argument("--seeds", type=_ints, default=None, help="Comma-separated seeds (default: the preset's).")
    p.add_argument("--train-iters", type=int, default=None, help="Steps per run (default: the preset's).")
    p.add_argument("--fa-onset", type=int, default=None, help="Override the fa fault onset step.")
    p.add_argument("--fa-strength", type=float, default=None, help="Override the fa fault strength (BF16 ulps).")
    p.add_argument("--calibration-seed", type=int, default=None,
                   help="Clean seed (not reported) on which the detector setting is chosen "
                        "(default: the preset's; -1 = none, use the default detector setting).")
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="Runs in parallel (default: cores).")
    p.add_argument("--trainer", default=None, help="Training script (default: the example trainer).")
    p.add_argument("--no-plots", action="store_true", help="Skip the PNG plots.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    p.add_argument("--analyze-only", action="store_true", help="Re-analyse the runs already in --out.")
    p.add_argument("--sensitivity", action="store_true",
                   help="With --analyze-only: print what every candidate detector setting would have reported "
                        "on the recorded runs (post hoc; writes nothing).")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.sensitivity:
        if not args.analyze_only:
            raise SystemExit("--sensitivity needs --analyze-only (it replays recorded runs)")
        print(markdown_sensitivity(sensitivity(args.out)))
        return 0
    if args.analyze_only:
        results = analyze_study(args.out, plots_enabled=not args.no_plots)
    else:
        preset = get_preset(args.preset)
        overrides = {k: v for k, v in (("fa_onset", args.fa_onset), ("fa_strength", args.fa_strength)) if v is not None}
        preset = with_overrides(preset, **overrides) if overrides else preset
        scenarios = tuple(s.strip() for s in args.scenarios.split(",")) if args.scenarios else preset.scenarios
        for name in scenarios:
            get_scenario(name)  # ValueError names the choices
        calib = preset.calibration_seed if args.calibration_seed is None else args.calibration_seed
        options = StudyOptions(
            out_dir=args.out, preset=preset, scenarios=scenarios, seeds=args.seeds or preset.seeds,
            train_iters=args.train_iters, calibration_seed=None if calib is not None and calib < 0 else calib,
            jobs=args.jobs, trainer=args.trainer, progress=not args.no_progress, plots=not args.no_plots,
        )
        results = run_study(options)
    print(markdown_report(results))
    print(f"results: {os.path.join(args.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
