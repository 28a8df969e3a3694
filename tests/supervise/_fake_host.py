"""A tiny stand-in host for the supervisor's bad-input tests: a real process that starts in
milliseconds and plays one scripted outcome per launch (what a real trainer cannot be made to do
on demand: a corrupt alert, another run's alert, an abort without an alert).

``--plan a,b,c``: the outcome of launch 1, 2, 3 (the last repeats). Outcomes:
``ok`` exit 0; ``alarm`` checkpoints at 5 and 10, abort checkpoint at 12 with this run's alert
(family ``--family``, first warning ``--first-warning``), exit ``--mechmon-exit-code``;
``corrupt`` / ``other`` / ``noalert`` the same abort with a garbled alert, another run's alert,
no alert; ``crash`` exit 3; ``sleep`` 60 s (for signals). ``--layout deepspeed``: DeepSpeed tag
folders and ``latest``. Every launch appends its argv to ``<save>/launches.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _checkpoint(save: str, iteration: int) -> str:
    path = os.path.join(save, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return path


def _tag(save: str, step: int) -> str:
    path = os.path.join(save, f"global_step{step}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "mp_rank_00_model_states.pt"), "wb") as f:
        f.write(b"x")
    with open(os.path.join(save, "latest"), "w") as f:
        f.write(f"global_step{step}")
    return path


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--save", required=True)
    p.add_argument("--load")
    p.add_argument("--ckpt-step", type=int)
    p.add_argument("--ckpt-tag")
    p.add_argument("--layout", default="megatron", choices=["megatron", "deepspeed"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--override-opt_param-scheduler", action="store_true")
    p.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    p.add_argument("--fa-fp32-o", action="store_true")
    p.add_argument("--fa-tie-shift-beta", type=float)
    p.add_argument("--attention-backend", default="local", choices=["local", "torch", "emulated-lowp-fa"])
    p.add_argument("--mechmon-drill-at", type=int)
    p.add_argument("--mechmon-exit-code", type=int, default=42)
    p.add_argument("--tensorboard-dir")
    p.add_argument("--plan", default="ok")
    p.add_argument("--family", default="attn_delta2")
    p.add_argument("--first-warning", type=int, default=9)
    args = p.parse_args()
    os.makedirs(args.save, exist_ok=True)
    log = os.path.join(args.save, "launches.jsonl")
    launch = sum(1 for _ in open(log)) + 1 if os.path.exists(log) else 1
    with open(log, "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\n")
    plan = args.plan.split(",")
    outcome = plan[min(launch, len(plan)) - 1]
    if outcome == "ok":
        return 0
    if outcome == "crash":
        return 3
    if outcome == "sleep":
        time.sleep(60)
        return 0
    save_at = _checkpoint if args.layout == "megatron" else _tag
    resumes = args.load is not None and any(os.path.exists(os.path.join(args.load, name))
                                            for name in ("latest_checkpointed_iteration.txt", "latest"))
    if not resumes or (args.ckpt_step is not None and args.load != args.save):  # not a rollback
        save_at(args.save, 5)
        save_at(args.save, 10)
    abort = save_at(args.save, 12)
    alert = {"iteration": 12, "family": args.family, "first_warning_step": args.first_warning, "layers": [1],
             "heads": [0], "checkpoint_dir": abort, "action": "checkpoint-and-abort",
             "exit_code": args.mechmon_exit_code}
    if outcome == "other":
        alert["checkpoint_dir"] = "/elsewhere/iter_0000012"
    if outcome != "noalert":
        with open(os.path.join(abort, "mechmon_alert.json"), "w") as f:
            f.write("{garbled" if outcome == "corrupt" else json.dumps(alert))
    return args.mechmon_exit_code


if __name__ == "__main__":
    sys.exit(main())
