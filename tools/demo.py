"""`make demo`: a short fault study (clean, fa, moe-lr; seed 1; 1,000 steps) and the fa run recovered, on CPU.

Trains three small megatron-core GPT-MoE runs with the mechanism monitors on (preset ``demo`` of
mechmon_megatron/research/study/scenarios.py; the fa fault is an AMPLIFIED injection, see docs/RESULTS.md),
then prints the table of first alarms, divergence and leads, and where the TensorBoard logs,
results.json and the plots are; then a fourth line: the same fa run under ``mechmon-supervise``
(checkpoint-and-abort, a save every 100 steps): rolled back to the newest checkpoint at or before
the alarm's change point, relaunched with the default policy's attention remedy, trained to the
same last step; its row (alarm, rollback, remedy, final loss against the clean run). ``--no-recovery``
leaves the fourth line out (the three runs only).

    python tools/demo.py [--out demo_out] [--jobs N] [--train-iters N] [--no-recovery]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mechmon_megatron.research.recovery_study.demo_recovery import (
    finish_recovered_fa,
    recovered_row,
    start_recovered_fa,
)
from mechmon_megatron.research.reproducible_cpu import PINNED_CPU_SETTINGS, check_pin, overridden_settings
from mechmon_megatron.research.study.demo_footing import footing_lines
from mechmon_megatron.research.study.early_phase_report import rule_thresholds
from mechmon_megatron.research.study.report import markdown_report, reported_runs
from mechmon_megatron.research.study.scenarios import METRICS_FILE, get_preset
from mechmon_megatron.research.study.study import StudyOptions, load_runs, run_study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: demo_out/ goes there


def reproducibility_line(capability: str) -> str:
    """Everything the numbers depend on (docs/RESULTS.md, "Reproducibility"): the corpus bytes (the
    standard library of this Python), torch and its MKL, the pinned CPU settings, and the ATen
    kernels a process started under the pin gets (the runs are started the same way)."""
    import platform
    import re

    import torch

    from gpt_trainer.data import corpus_fingerprint, stdlib_corpus

    corpus = corpus_fingerprint(stdlib_corpus(4 * 1024 * 1024).tokens)
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", torch.__config__.show())
    pins = " ".join(f"{k}={v}" for k, v in PINNED_CPU_SETTINGS.items())
    return (f"reproducibility: corpus sha256 {corpus} (stdlib of Python {platform.python_version()}), "
            f"torch {torch.__version__} (MKL {mkl.group(1) if mkl else 'none'}), {pins}, "
            f"ATen kernels in use {capability}")


def kernel_warnings() -> tuple[str, list[str]]:
    """The ATen capability the runs get, and one line per setting that makes this machine's table
    differ from the docs (the pin overrides the caller's values only inside the demo's runs)."""
    lines = [f"note: {line}" for line in overridden_settings()]
    pin = check_pin()
    lines += [f"warning: {reason}; the table may differ from docs/RESULTS.md" for reason in pin.reasons]
    return pin.capability, lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "demo_out"), help="Output directory (default: demo_out/).")
    p.add_argument("--jobs", type=int, default=3,
                   help="Runs in parallel (default 3: all at once; each run uses one thread).")
    p.add_argument("--train-iters", type=int, default=None, help="Steps per run (default: the demo preset's).")
    p.add_argument("--trainer", default=None, help="Training script (default: the example trainer).")
    p.add_argument("--no-recovery", dest="recovery", action="store_false",
                   help="Leave out the fourth line (the fa run under mechmon-supervise: about 1,240 more steps).")
    args = p.parse_args(argv)
    preset = get_preset("demo")
    iters = args.train_iters or preset.train_iters
    fourth = " and the fa run under mechmon-supervise beside them" if args.recovery else ""
    print(f"mechmon demo: scenarios {', '.join(preset.scenarios)}, seed {preset.seeds[0]}, {iters} steps each, "
          f"{args.jobs} runs in parallel{fourth} (11 minutes for the three runs on 2 idle CPU cores; the fourth "
          "adds about 1,300 steps)", flush=True)
    capability, kernel_lines = kernel_warnings()
    for line in kernel_lines:
        print(line, flush=True)
    start = time.monotonic()
    # Fourth line: the fa run under mechmon-supervise, started beside the three runs below.
    recovering = None if not args.recovery else start_recovered_fa(os.path.abspath(args.out), preset, iters)
    results = run_study(
        StudyOptions(out_dir=args.out, preset=preset, scenarios=preset.scenarios, seeds=preset.seeds,
                     train_iters=iters, jobs=args.jobs, trainer=args.trainer)
    )
    print()
    _, data = load_runs(args.out)
    print("\n".join(footing_lines(reported_runs(results), data, rule_thresholds())))
    print()
    print(markdown_report(results))
    print(reproducibility_line(capability))
    out = os.path.abspath(args.out)
    print(f"wall time: {time.monotonic() - start:.0f} s")
    if recovering is not None:
        print(f"\nfourth line: the fa run under mechmon-supervise (rollback, remedy, relaunch to step {iters}) ...",
              flush=True)
        recovered = finish_recovered_fa(recovering)
        for line in recovered_row(recovered, os.path.join(out, "runs", "clean-seed1", METRICS_FILE)):
            print(line)
        print(f"wall time with the fourth line: {time.monotonic() - start:.0f} s")
    print(f"results:     {os.path.join(out, 'results.json')}")
    print(f"report:      {os.path.join(out, 'report.md')}")
    print(f"plots:       {os.path.join(out, 'plots')}")
    print(f"TensorBoard: tensorboard --logdir {os.path.join(out, 'runs')}")
    failed = [r for r in results["runs"] if r.get("returncode")]
    for r in failed:
        print(f"run {r['run_id']} exited with {r['returncode']}:\n{r.get('error_tail', '')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
