#!/usr/bin/env python
"""The MoE learning-rate fault on the DeepSpeed example: does the routing-entropy alarm fire
before expert collapse?

Trains ``examples/pretrain_scripts/deepspeed_moe_mechmon.py`` (DeepSpeed MoE layer, CPU, gloo,
one process per run) at several peak learning rates and seeds, then analyses every run with the
fault study's definitions (``mechmon_megatron.research.study.analysis``): expert collapse = MaxVio >= 2 in
some layer at 5 consecutive checks; loss divergence = the smoothed-loss rule; mechmon alarms
replayed with the session's default detector setting (== what the run raised online). The first
LR is the healthy control; every other LR counts as a fault from step 1.

Each run writes ``OUT/runs/lr<LR>-seed<S>/`` (``monitor/`` = DeepSpeed's CSV monitor,
``mechmon/`` = ``mechmon_scalars.jsonl`` and TensorBoard events, ``stdout.log``,
``command.txt``); the study writes ``OUT/results.json`` and ``OUT/effective_experts.png``
(effective experts per token against the step, per seed and LR) and prints a markdown table,
or with ``--json`` the results as JSON on stdout.

    python tools/deepspeed_lr_study.py --lrs 2e-3,8e-3,3e-2,1e-1 --seeds 2,3 --jobs 2 \\
        --out runs/ds_lr_study
    python tools/deepspeed_lr_study.py --out runs/ds_lr_study --analyze-only
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from typing import Any, Optional

from mechmon_megatron.research.study.analysis import (
    DEFAULT_DETECTOR,
    RunData,
    analyze_run,
    read_jsonl,
    replay_mechmon,
)
from mechmon_megatron.research.study.runner import launch_runs
from mechmon_megatron.research.study.scenarios import RunSpec

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "pretrain_scripts", "deepspeed_moe_mechmon.py")
"""The DeepSpeed example script of this checkout (beside tools/)."""
JOB_NAME = "deepspeed_moe_mechmon"  # csv_monitor.job_name of the example's ds_config
LOSS_CSV = os.path.join("monitor", JOB_NAME, "Train_lm_loss.csv")
MECHMON_JSONL = os.path.join("mechmon", "mechmon_scalars.jsonl")
ENTROPY_STEPS = (100, 200, 400)


def run_id(lr: float, seed: int) -> str:
    return f"lr{lr:g}-seed{seed}"


def plan(lrs: list[float], seeds: list[int], train_iters: int, extra: list[str]) -> list[RunSpec]:
    """One spec per (LR, seed); the first LR is the healthy control (no fault onset)."""
    specs = []
    for seed in seeds:
        for i, lr in enumerate(lrs):
            flags = ("--lr", f"{lr:g}", "--seed", str(seed), "--train-iters", str(train_iters), *extra)
            specs.append(RunSpec(scenario=f"lr{lr:g}", seed=seed, train_iters=train_iters,
                                 fault_onset=None if i == 0 else 1, flags=flags))
    return specs


def command_for(spec: RunSpec, directory: str, interval: int, delta: int) -> list[str]:
    """A one-process torchrun launch of the example with its outputs in ``directory``."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        EXAMPLE, "--no-shm-comm-op", *spec.flags,
        "--monitor-dir", os.path.join(directory, "monitor"),
        "--mechmon-set", f"interval={interval}", "--mechmon-set", f"delta={delta}",
        "--mechmon-set", "action=log", "--mechmon-set", "per_head_scalars=true",
        "--mechmon-set", f"log_dir={json.dumps(os.path.join(directory, 'mechmon'))}",
    ]


def read_loss_csv(path: str) -> list[dict[str, Any]]:
    """DeepSpeed csv_monitor rows ``step,value`` -> metrics rows ``{"iteration", "lm_loss"}``."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for row in csv.reader(f):
                try:
                    rows.append({"iteration": int(float(row[0])), "lm_loss": float(row[1])})
                except (ValueError, IndexError):
                    continue  # the header line
    except FileNotFoundError:
        pass
    return rows


def entropy_profile(data: RunData) -> dict[str, Any]:
    """Lowest layer's normalised routing entropy at a few steps and over the run, the lowest
    effective number of experts, and the MaxVio peak."""
    lowest: dict[int, float] = {}
    lowest_eff, vio_peak = math.inf, -math.inf
    for step, scalars in data.checks:
        norms = [v for k, v in scalars.items() if k.startswith("mechmon/router/token_entropy_norm/")]
        if norms:
            lowest[step] = min(norms)
        effs = [v for k, v in scalars.items() if k.startswith("mechmon/router/effective_experts/")]
        lowest_eff = min([lowest_eff, *effs])
        vio_peak = max([vio_peak, *(v for k, v in scalars.items() if k.startswith("mechmon/router/max_vio/"))])
    return {
        "norm_entropy_at": {str(s): lowest.get(s) for s in ENTROPY_STEPS},
        "norm_entropy_min": min(lowest.values()) if lowest else None,
        "effective_experts_min": lowest_eff if math.isfinite(lowest_eff) else None,
        "max_vio_peak": vio_peak if math.isfinite(vio_peak) else None,
    }


def without_floor(data: RunData) -> RunData:
    """The same run with the recorded routing-entropy floor removed: what the baseline-relative
    rule alone would have reported."""
    checks = [(s, {k: v for k, v in sc.items() if "/token_entropy_floor/" not in k}) for s, sc in data.checks]
    return RunData(data.steps, data.loss, data.grad_norm, data.max_attn_logit, checks)


def load_run(out: str, spec: RunSpec) -> RunData:
    directory = os.path.join(out, "runs", spec.run_id)
    return RunData.from_rows(read_loss_csv(os.path.join(directory, LOSS_CSV)),
                             read_jsonl(os.path.join(directory, MECHMON_JSONL)))


def plot(out: str, specs: list[RunSpec], results: list[dict[str, Any]]) -> str:
    """``OUT/effective_experts.png``: one panel per seed, one line per LR, and the floor the
    runs recorded (``mechmon/router/token_entropy_floor/*``, as effective experts)."""
    from mechmon_megatron.research.study.plots import plot_effective_experts

    panels: dict[str, list] = {}
    floor: Optional[float] = None
    for spec, r in zip(specs, results):
        data = load_run(out, spec)
        run = {
            "router_entropy_alarm": r["first_alarm"]["router_entropy"],
            "expert_collapse_step": r["expert_collapse_step"],
        }
        panels.setdefault(f"seed {spec.seed}", []).append((f"LR {r['lr']:g}", data, run))
        floors = [v for _, sc in data.checks for k, v in sc.items() if "/token_entropy_floor/" in k]
        floor = math.exp(floors[0]) if floors and floor is None else floor
    return plot_effective_experts(panels, floor, os.path.join(out, "effective_experts.png"))


def analyze(out: str, specs: list[RunSpec], interval: int = 20, delta: int = 100) -> list[dict[str, Any]]:
    results = []
    for spec in specs:
        data = load_run(out, spec)
        run = analyze_run(data, fault_onset=spec.fault_onset, interval=interval, delta=delta)
        tail = data.loss[-50:]
        results.append(
            {
                "run": spec.run_id,
                "lr": float(spec.flags[1]),
                "seed": spec.seed,
                "fault": spec.fault_onset is not None,
                "steps_recorded": run["steps_recorded"],
                "num_checks": run["num_checks"],
                "final_loss_ma50": math.fsum(tail) / len(tail) if tail else None,
                "divergence_step": run["divergence_step"],
                "expert_collapse_step": run["expert_collapse_step"],
                "online_first_alarm": run["online_first_alarm"],
                "first_alarm": {
                    k: run["first_alarm"][k] for k in ("router_entropy", "router_weights", "attn_delta2", "attn_dw")
                },
                "first_alarm_stream": run["first_alarm_stream"],
                "router_entropy_alarm_without_floor": replay_mechmon(without_floor(data), DEFAULT_DETECTOR)[
                    "first_alarm"
                ]["router_entropy"],
                **entropy_profile(data),
            }
        )
    return results


def _fmt(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def markdown(results: list[dict[str, Any]]) -> str:
    head = ("| run | LR | seed | final loss (MA50) | divergence | expert collapse | routing-entropy alarm | "
            "same without the floor | weight-sim alarm | attention alarm (Δ2 / dW) | online first alarm | "
            "min norm. entropy (100 / 200 / 400 / run) | min eff. experts | MaxVio peak |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ent = r["norm_entropy_at"]
        lines.append("| " + " | ".join([
            r["run"], f"{r['lr']:g}", str(r["seed"]), _fmt(r["final_loss_ma50"]), _fmt(r["divergence_step"]),
            _fmt(r["expert_collapse_step"]), _fmt(r["first_alarm"]["router_entropy"]),
            _fmt(r["router_entropy_alarm_without_floor"]), _fmt(r["first_alarm"]["router_weights"]),
            f"{_fmt(r['first_alarm']['attn_delta2'])} / {_fmt(r['first_alarm']['attn_dw'])}",
            _fmt(r["online_first_alarm"]),
            " / ".join(_fmt(ent[str(s)]) for s in ENTROPY_STEPS) + f" / {_fmt(r['norm_entropy_min'])}",
            _fmt(r["effective_experts_min"], 2), _fmt(r["max_vio_peak"], 2),
        ]) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--lrs", default="2e-3,8e-3,3e-2,1e-1", help="Peak LRs, comma-separated; the first is the healthy control."
    )
    p.add_argument("--seeds", default="1", help="Seeds, comma-separated.")
    p.add_argument("--train-iters", type=int, default=1500)
    p.add_argument("--interval", type=int, default=20, help="mechmon check interval (steps).")
    p.add_argument("--delta", type=int, default=100, help="mechmon increment window (steps).")
    p.add_argument("--jobs", type=int, default=2, help="Runs in parallel (one core each).")
    p.add_argument("--out", default=os.path.join("runs", "ds_lr_study"))
    p.add_argument("--analyze-only", action="store_true", help="Re-analyse existing runs, no training.")
    p.add_argument("--extra", default="", help="Extra example flags for every run, e.g. \"--aux-loss-coeff 0\".")
    p.add_argument("--json", action="store_true", help="Print the results as JSON instead of the table.")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plot", action="store_true", help="Skip OUT/effective_experts.png.")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError as exc:
        raise SystemExit(f"--lrs / --seeds: {exc}") from None
    if not lrs or not seeds:
        raise SystemExit("--lrs and --seeds need at least one value each")
    specs = plan(lrs, seeds, args.train_iters, args.extra.split())
    wall = None
    if not args.analyze_only:
        start = time.perf_counter()
        launched = launch_runs(
            specs, args.out, jobs=args.jobs, progress=not args.no_progress, progress_file=LOSS_CSV,
            command_for=lambda spec, d: command_for(spec, d, args.interval, args.delta),
            env_overrides={"DS_ACCELERATOR": "cpu"}, desc="deepspeed LR study",
        )
        wall = time.perf_counter() - start
        for r in launched:
            if r.returncode:
                print(f"run {r.spec.run_id} exited {r.returncode}:\n{r.tail}", file=sys.stderr)
    results = analyze(args.out, specs, args.interval, args.delta)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    if wall is None and os.path.exists(path):  # --analyze-only keeps the training time it measured
        with open(path, encoding="utf-8") as f:
            wall = json.load(f).get("training_wall_s")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "training_wall_s": wall, "runs": results}, f, indent=2)
    if not args.no_plot:
        print(f"plot: {plot(args.out, specs, results)}", file=sys.stderr)
    print(json.dumps(results, indent=2) if args.json else markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
