"""The fourth line of ``make demo``: the demo's fa run recovered by ``mechmon-supervise``.

The same flags as the demo's fa run (preset ``demo``, seed 1), with ``--mechmon-action
checkpoint-and-abort`` and a save every 100 steps, run under ``mechmon-supervise`` with the
default policy: the detector alarms, the supervisor rolls back to the newest checkpoint at or
before the alarm's change point, applies the attention remedy and relaunches; the relaunch trains
to the demo's last step. The row compares its loss (last 100 steps) with the demo's clean run.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from typing import Any, Optional

from mechmon_megatron.research.study.runner import build_command, run_environment
from mechmon_megatron.research.study.scenarios import METRICS_FILE, Preset, plan_runs
from mechmon_megatron.supervise.command import parse_command, set_flag

SAVE_INTERVAL = 100
SMOOTH_STEPS = 100


def _rows(path: str) -> dict[int, float]:
    """Iteration -> loss; a later row of an iteration wins (the relaunch after a rollback)."""
    out: dict[int, float] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    loss = row.get("lm_loss")
                    out[int(row["iteration"])] = math.nan if loss is None else float(loss)
    except FileNotFoundError:
        pass
    return out


def smoothed_loss(path: str, last_step: int) -> Optional[float]:
    rows = _rows(path)
    values = [v for i, v in rows.items() if last_step - SMOOTH_STEPS < i <= last_step]
    if len(values) < SMOOTH_STEPS or not all(math.isfinite(v) for v in values):
        return None
    return sum(values) / len(values)


def start_recovered_fa(out_dir: str, preset: Preset, train_iters: int) -> dict[str, Any]:
    """Start the supervised fa run under ``out_dir/recovered-fa`` (a fresh folder every time);
    :func:`finish_recovered_fa` waits for it. Started beside the demo's three runs, it adds little
    wall time on 2 cores."""
    spec = plan_runs(("fa",), preset.seeds[:1], preset, train_iters)[0]
    directory = os.path.join(out_dir, "recovered-fa")
    if os.path.isdir(directory):
        import shutil

        shutil.rmtree(directory)  # the demo's own output folder: a fresh run every time
    os.makedirs(directory)
    save = os.path.join(directory, "ck")
    command = parse_command(build_command(spec, directory))
    host = set_flag(command.host_args, "--mechmon-action", ["checkpoint-and-abort"])
    host = set_flag(set_flag(host, "--save", [save]), "--save-interval", [str(SAVE_INTERVAL)])
    argv = [sys.executable, "-m", "mechmon_megatron.supervise", "--", *command.with_host_args(host).argv]
    with open(os.path.join(directory, "command.txt"), "w", encoding="utf-8") as f:
        f.write(shlex.join(argv) + "\n")
    log = open(os.path.join(directory, "stdout.log"), "w", encoding="utf-8")
    proc = subprocess.Popen(argv, env=run_environment(), stdout=log, stderr=subprocess.STDOUT)
    return {"proc": proc, "log": log, "started": time.monotonic(), "directory": directory, "save": save,
            "metrics": os.path.join(directory, METRICS_FILE), "train_iters": train_iters}


def finish_recovered_fa(run: dict[str, Any], timeout_s: float = 3600.0) -> dict[str, Any]:
    """Wait for the run of :func:`start_recovered_fa`; its record for the table."""
    try:
        returncode = run["proc"].wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run["proc"].terminate()
        returncode = run["proc"].wait()
    run["log"].close()
    records = []
    path = os.path.join(run["save"], "mechmon_recovery.jsonl")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    return {"returncode": returncode, "wall_s": time.monotonic() - run["started"], "records": records,
            "directory": run["directory"], "metrics": run["metrics"], "train_iters": run["train_iters"]}


def run_recovered_fa(out_dir: str, preset: Preset, train_iters: int, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Start and wait (see :func:`start_recovered_fa`)."""
    return finish_recovered_fa(start_recovered_fa(out_dir, preset, train_iters), timeout_s)


def remedy_flags(added: list[str], removed: list[str]) -> str:
    """``set --a x; dropped --b y`` from a recovery record's flag lists: the rollback's own
    ``--load`` / ``--ckpt-step`` left out, a replaced flag's old value not repeated as dropped."""
    added = [x for x in added if not x.startswith(("--load ", "--ckpt-step "))]
    replaced = {x.split()[0] for x in added}
    dropped = [x for x in removed if x.split()[0] not in replaced]
    return "; ".join(part for part in (f"set {', '.join(added)}" if added else "",
                                       f"dropped {', '.join(dropped)}" if dropped else "") if part)


def where(alert: dict[str, Any]) -> str:
    """`` layer 1 heads 2,1,0`` from an alert's ``layers`` / ``heads`` (empty when it names none)."""
    return "".join(f" {key[:-1] if len(alert[key]) == 1 else key} {','.join(map(str, alert[key]))}"
                   for key in ("layers", "heads") if alert.get(key))


def recovered_row(result: dict[str, Any], clean_metrics: str) -> list[str]:
    """Lines for the demo's output: a small table with the recovered run's row."""
    relaunches = [r for r in result["records"] if r.get("action") == "relaunch"]
    iters = result["train_iters"]
    loss = smoothed_loss(result["metrics"], iters)
    clean = smoothed_loss(clean_metrics, iters)
    lines = ["| run | alarm (change point) | rollback | remedy | restarts | final loss (last 100) | clean | vs clean |",
             "|---|---|---|---|---|---|---|---|"]
    if not relaunches:
        lines.append(f"| fa recovered | no relaunch (supervisor exit {result['returncode']}) | | | 0 | "
                     f"{'-' if loss is None else f'{loss:.3f}'} | {'-' if clean is None else f'{clean:.3f}'} | |")
        return lines
    r = relaunches[0]
    a, c = r["alert"], r["checkpoint"]
    gap = "-" if loss is None or clean is None else f"{100 * (loss / clean - 1):+.1f} %"
    flags = remedy_flags(r["flags_added"], r["flags_removed"])
    lines.append(
        f"| fa recovered by mechmon-supervise | {a['family']}{where(a)} at {a['iteration']} "
        f"({a['first_warning_step']}) | "
        f"{c['name']}{' (AFTER the change point)' if r.get('after_change_point') else ''} | {r['remedy']}: {flags} | "
        f"{len(relaunches)} | {'-' if loss is None else f'{loss:.3f}'} | {'-' if clean is None else f'{clean:.3f}'} | "
        f"{gap} |")
    lines.append(f"(supervisor exit {result['returncode']}, {result['wall_s']:.0f} s; records: "
                 f"{os.path.join(result['directory'], 'ck', 'mechmon_recovery.jsonl')})")
    return lines
