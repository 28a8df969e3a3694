"""`make demo`: a short fault study (clean, fa, moe-lr; seed 1; 1,000 steps) on CPU in <= 10 minutes.

Trains three small megatron-core GPT-MoE runs with the mechanism monitors on (preset ``demo`` of
mechmon_megatron/research/study/scenarios.py; the fa fault is an AMPLIFIED injection, see docs/RESULTS.md),
then prints the table of first alarms, divergence and leads, and where the TensorBoard logs,
results.json and the plots are.

    python tools/demo.py [--out demo_out] [--jobs N] [--train-iters N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mechmon_megatron.research.study.report import markdown_report
from mechmon_megatron.research.study.runner import REPRODUCIBLE_KERNELS
from mechmon_megatron.research.study.scenarios import get_preset
from mechmon_megatron.research.study.study import StudyOptions, run_study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: demo_out/ goes there


def reproducibility_line() -> str:
    """What the numbers depend on: the corpus bytes, torch and its CPU kernels (docs/RESULTS.md)."""
    import platform

    import torch

    from gpt_trainer.data import corpus_fingerprint, stdlib_corpus

    corpus = corpus_fingerprint(stdlib_corpus(4 * 1024 * 1024).tokens)
    capability = os.environ.get("ATEN_CPU_CAPABILITY", REPRODUCIBLE_KERNELS["ATEN_CPU_CAPABILITY"])
    return (f"reproducibility: corpus sha256 {corpus} (stdlib of Python {platform.python_version()}), "
            f"torch {torch.__version__}, CPU kernels {capability}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "demo_out"), help="Output directory (default: demo_out/).")
    p.add_argument("--jobs", type=int, default=3,
                   help="Runs in parallel (default 3: all at once; each run uses one thread).")
    p.add_argument("--train-iters", type=int, default=None, help="Steps per run (default: the demo preset's).")
    p.add_argument("--trainer", default=None, help="Training script (default: the example trainer).")
    args = p.parse_args(argv)
    preset = get_preset("demo")
    iters = args.train_iters or preset.train_iters
    print(f"mechmon demo: scenarios {', '.join(preset.scenarios)}, seed {preset.seeds[0]}, {iters} steps each, "
          f"{args.jobs} runs in parallel (about 10 minutes on 2 CPU cores)", flush=True)
    start = time.monotonic()
    results = run_study(
        StudyOptions(out_dir=args.out, preset=preset, scenarios=preset.scenarios, seeds=preset.seeds,
                     train_iters=iters, jobs=args.jobs, trainer=args.trainer)
    )
    print()
    print(markdown_report(results))
    print(reproducibility_line())
    out = os.path.abspath(args.out)
    print(f"wall time: {time.monotonic() - start:.0f} s")
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
