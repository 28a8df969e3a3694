"""Launch a campaign of long runs that survives interruption: resume, fork, stop when told.

Each run lives in ``OUT/runs/<run_id>/`` (the files of :mod:`~mechmon_megatron.research.study.runner`
plus ``ckpt/`` and ``status.json``). Launching the campaign again picks up where it stopped:

- a run whose ``status.json`` says it is finished is skipped;
- a run with a checkpoint is resumed from its latest one (``--load``); its JSONL records after
  that iteration are dropped first, so every step is recorded once;
- a fork (``parent`` / ``fork_at``) waits until the parent's checkpoint at ``fork_at`` is
  complete, copies it, and starts from it;
- ``interrupt_at``: the first launch saves and exits there (``--exit-interval``), the next one
  resumes: a deliberate mid-run restart;
- ``stop_after_divergence``: the run is stopped that many steps after its loss divergence
  (:class:`~mechmon_megatron.research.study.analysis.DivergenceRule`, on the parent's steps too).

Processes are independent single-process worlds with one torch thread each and the study's
pinned CPU kernels (:func:`~mechmon_megatron.research.study.runner.run_environment`); ``jobs``
runs at once. Stopping the launcher (Ctrl-C, SIGTERM) stops its children; their last checkpoints stay.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from mechmon_megatron.research.study.analysis import DivergenceRule, read_jsonl
from mechmon_megatron.research.study.long_plan import CampaignRun
from mechmon_megatron.research.study.runner import (
    exit_on_sigterm,
    progress_bar,
    run_environment,
    tail_of,
    trainer_command,
)
from mechmon_megatron.research.study.scenarios import MECHMON_DIR, METRICS_FILE, TENSORBOARD_DIR

CKPT_DIR = "ckpt"
STATUS_FILE = "status.json"
TRACKER = "latest_checkpointed_iteration.txt"
SCALARS_FILE = "mechmon_scalars.jsonl"


def run_dir(out_dir: str, run: CampaignRun) -> str:
    return os.path.join(out_dir, "runs", run.run_id)


def read_status(directory: str) -> dict:
    try:
        with open(os.path.join(directory, STATUS_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_status(directory: str, status: dict) -> None:
    tmp = os.path.join(directory, STATUS_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(status, f, indent=1)
    os.replace(tmp, os.path.join(directory, STATUS_FILE))


def latest_checkpoint(directory: str) -> Optional[int]:
    """Iteration of the last complete checkpoint in ``directory/ckpt`` (None without one)."""
    try:
        with open(os.path.join(directory, CKPT_DIR, TRACKER), encoding="utf-8") as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def is_finished(directory: str) -> bool:
    return read_status(directory).get("state") in ("done", "stopped-after-divergence")


def _truncate_jsonl(path: str, key: str, last: int) -> None:
    """Keep the rows with ``row[key] <= last`` (and drop a torn last line)."""
    if not os.path.exists(path):
        return
    rows = [r for r in read_jsonl(path) if int(r[key]) <= last]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)


def _parent_ready(out_dir: str, run: CampaignRun) -> bool:
    parent = os.path.join(out_dir, "runs", run.parent)
    tracker = latest_checkpoint(parent)
    return tracker is not None and tracker >= run.fork_at and os.path.isdir(
        os.path.join(parent, CKPT_DIR, f"iter_{run.fork_at:07d}"))


def _prepare(out_dir: str, run: CampaignRun) -> tuple[list[str], str]:
    """Set up the run directory for the next launch; returns (extra flags, how it starts)."""
    directory = run_dir(out_dir, run)
    ckpt = os.path.join(directory, CKPT_DIR)
    resume_at = latest_checkpoint(directory)
    if resume_at is not None:
        _truncate_jsonl(os.path.join(directory, METRICS_FILE), "iteration", resume_at)
        _truncate_jsonl(os.path.join(directory, MECHMON_DIR, SCALARS_FILE), "step", resume_at)
        return ["--load", ckpt], f"resumed at {resume_at}"
    if os.path.isdir(directory):
        shutil.rmtree(directory)
    os.makedirs(ckpt)
    if run.parent is None:
        return [], "fresh"
    source = os.path.join(out_dir, "runs", run.parent, CKPT_DIR, f"iter_{run.fork_at:07d}")
    shutil.copytree(source, os.path.join(ckpt, f"iter_{run.fork_at:07d}"))
    with open(os.path.join(ckpt, TRACKER), "w", encoding="utf-8") as f:
        f.write(str(run.fork_at))
    return ["--load", ckpt], f"forked from {run.parent} at {run.fork_at}"


def build_command(run: CampaignRun, directory: str, extra: Sequence[str], first_launch: bool,
                  python: str = sys.executable) -> list[str]:
    cmd = [
        *trainer_command(python=python), *run.flags, "--num-threads", "1",
        "--metrics-jsonl", os.path.join(directory, METRICS_FILE),
        "--mechmon-log-dir", os.path.join(directory, MECHMON_DIR),
        "--tensorboard-dir", os.path.join(directory, TENSORBOARD_DIR),
        "--save", os.path.join(directory, CKPT_DIR), "--save-interval", str(run.save_interval), *extra,
    ]
    if run.save_at:
        cmd += ["--save-at-iters", ",".join(str(i) for i in run.save_at)]
    if run.interrupt_at and first_launch:
        cmd += ["--exit-interval", str(run.interrupt_at)]
    return cmd


def combined_losses(out_dir: str, run: CampaignRun) -> tuple[list[int], list[float]]:
    """The run's per-step loss, preceded by its parent's steps up to the fork."""
    rows = read_jsonl(os.path.join(run_dir(out_dir, run), METRICS_FILE))
    if run.parent is not None:
        parent_rows = read_jsonl(os.path.join(out_dir, "runs", run.parent, METRICS_FILE))
        rows = [r for r in parent_rows if int(r["iteration"]) <= run.fork_at] + rows
    rows.sort(key=lambda r: int(r["iteration"]))
    loss = [float("nan") if r.get("lm_loss") is None else float(r["lm_loss"]) for r in rows]
    return [int(r["iteration"]) for r in rows], loss


def _diverged_long_enough(out_dir: str, run: CampaignRun) -> Optional[int]:
    steps, losses = combined_losses(out_dir, run)
    if not steps:
        return None
    divergence = DivergenceRule().first_step(steps, losses)
    if divergence is not None and steps[-1] >= divergence + run.stop_after_divergence:
        return divergence
    return None


def launch_campaign(runs: Sequence[CampaignRun], out_dir: str, jobs: int = 2, progress: bool = True,
                    poll_s: float = 5.0) -> dict[str, dict]:
    """Run (or resume) every run; returns ``{run_id: status}``."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}.")
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
    env = run_environment()
    pending = [r for r in runs if not is_finished(run_dir(out_dir, r))]
    active: dict[str, tuple[CampaignRun, subprocess.Popen, object, float]] = {}
    bar = progress_bar(len(runs), disable=not progress, desc="campaign runs")
    bar.update(len(runs) - len(pending))
    previous_handler = exit_on_sigterm()
    try:
        while pending or active:
            for run in list(pending):
                if len(active) >= jobs:
                    break
                if run.parent is not None and not _parent_ready(out_dir, run):
                    continue
                directory = run_dir(out_dir, run)
                status = read_status(directory)
                extra, how = _prepare(out_dir, run)
                status.setdefault("launches", [])
                cmd = build_command(run, directory, extra, first_launch=not status["launches"])
                status["launches"].append({"how": how, "started": time.time()})
                status["state"] = "running"
                _write_status(directory, status)
                with open(os.path.join(directory, "command.txt"), "a", encoding="utf-8") as f:
                    f.write(shlex.join(cmd) + "\n")
                log = open(os.path.join(directory, "stdout.log"), "a", encoding="utf-8")
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                active[run.run_id] = (run, proc, log, time.monotonic())
                pending.remove(run)
            waiting = {r.run_id for r in pending} | set(active)
            for run in [r for r in pending if r.parent is not None and r.parent not in waiting]:
                if not _parent_ready(out_dir, run):
                    # The parent is neither running nor queued and never reached the fork point
                    # (it failed, or is not part of this launch): the fork cannot start.
                    directory = run_dir(out_dir, run)
                    os.makedirs(directory, exist_ok=True)
                    _write_status(directory, {**read_status(directory), "state": "failed",
                                              "tail": f"parent {run.parent} has no checkpoint at {run.fork_at}"})
                    pending.remove(run)
                    bar.update(1)
            time.sleep(poll_s)
            for run_id in list(active):
                run, proc, log, start = active[run_id]
                directory = run_dir(out_dir, run)
                stopped_at = None
                if proc.poll() is None and run.stop_after_divergence is not None:
                    stopped_at = _diverged_long_enough(out_dir, run)
                    if stopped_at is not None:
                        proc.terminate()
                        proc.wait()
                if proc.poll() is None:
                    continue
                log.close()
                del active[run_id]
                status = read_status(directory)
                status["launches"][-1].update(returncode=proc.returncode, wall_s=time.monotonic() - start)
                last = max((int(r["iteration"]) for r in read_jsonl(os.path.join(directory, METRICS_FILE))), default=0)
                status["last_iteration"] = last
                if stopped_at is not None:
                    status.update(state="stopped-after-divergence", divergence=stopped_at)
                elif proc.returncode == 0 and last >= run.train_iters:
                    status["state"] = "done"
                elif proc.returncode == 0 and run.interrupt_at and len(status["launches"]) == 1:
                    status["state"] = "interrupted"
                    pending.insert(0, run)  # resume it next
                else:
                    status.update(state="failed", tail=tail_of(os.path.join(directory, "stdout.log")))
                _write_status(directory, status)
                if status["state"] != "interrupted":
                    bar.update(1)
                bar.set_postfix_str(f"running {len(active)}: {', '.join(sorted(active))}")
    finally:
        for _run, proc, log, _ in active.values():
            proc.terminate()
            log.close()
        bar.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    return {r.run_id: read_status(run_dir(out_dir, r)) for r in runs}
