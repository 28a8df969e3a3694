"""Launch the study's training runs as parallel subprocesses, with one progress bar.

Each run gets its own directory ``OUT/runs/<run_id>/`` with

- ``metrics.jsonl`` (the trainer's ``--metrics-jsonl``), which also feeds the progress bar;
- ``mechmon/`` (``--mechmon-log-dir``: ``mechmon_scalars.jsonl``);
- ``tensorboard/`` (``--tensorboard-dir``: loss, grad norm, LR and the ``mechmon/`` scalars);
- ``stdout.log`` (the trainer's output) and ``command.txt`` (the exact command line).

Runs are independent processes (world size 1, one torch thread each, ``--num-threads 1``), so
``jobs`` runs use about ``jobs`` cores. A run that exits non-zero is recorded with its exit code
and its last lines of output; the study goes on.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from mechmon_megatron.research.reproducible_cpu import pinned_environment
from mechmon_megatron.research.study.scenarios import MECHMON_DIR, METRICS_FILE, TENSORBOARD_DIR, RunSpec

TRAINER_MODULE = "gpt_trainer"
"""The example trainer with the monitors (``examples/pretrain_scripts/gpt_trainer``, its own
distribution, installed by ``make venv``): started as ``python -m gpt_trainer`` from any folder."""


def run_environment(overrides: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of one study run: the pinned CPU settings of
    :mod:`~mechmon_megatron.research.reproducible_cpu` (one thread, kernels that round the same on
    every x86-64 CPU; they win over the caller's environment, ``overrides`` win over them),
    unbuffered output, and no inherited torch.distributed rank variables (each run is its own
    single-process world)."""
    env = pinned_environment(overrides={"PYTHONUNBUFFERED": "1", **(overrides or {})})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def trainer_command(trainer: Optional[str] = None, python: str = sys.executable) -> list[str]:
    """The command that starts a trainer: ``python -m gpt_trainer``, or ``python TRAINER`` for a
    training script of your own that takes the same flags."""
    return [python, trainer] if trainer else [python, "-m", TRAINER_MODULE]


@dataclass
class RunResult:
    """Outcome of one launched run."""

    spec: RunSpec
    run_dir: str
    returncode: Optional[int]
    wall_s: float
    tail: str = ""


def run_dir(out_dir: str, spec: RunSpec) -> str:
    return os.path.join(out_dir, "runs", spec.run_id)


def build_command(spec: RunSpec, directory: str, trainer: Optional[str] = None,
                  python: str = sys.executable) -> list[str]:
    """The trainer command of one run, with its output paths (``trainer``: see :func:`trainer_command`)."""
    return [
        *trainer_command(trainer, python), *spec.flags,
        "--num-threads", "1",
        "--metrics-jsonl", os.path.join(directory, METRICS_FILE),
        "--mechmon-log-dir", os.path.join(directory, MECHMON_DIR),
        "--tensorboard-dir", os.path.join(directory, TENSORBOARD_DIR),
    ]


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def tail_of(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except FileNotFoundError:
        return ""


def progress_bar(total: int, disable: bool, desc: str):
    try:
        from tqdm import tqdm
    except ImportError as exc:  # tqdm is in the `test` extra
        raise ImportError("the fault study's progress bar needs tqdm: pip install 'mechmon-megatron[test]'") from exc
    return tqdm(total=total, unit="step", desc=desc, disable=disable, dynamic_ncols=True)


def launch_runs(
    specs: Sequence[RunSpec],
    out_dir: str,
    jobs: int = 1,
    trainer: Optional[str] = None,
    progress: bool = True,
    poll_s: float = 1.0,
    command_for: Optional[Callable[[RunSpec, str], list[str]]] = None,
    progress_file: str = METRICS_FILE,
    env_overrides: Optional[dict[str, str]] = None,
    desc: str = "fault study",
) -> list[RunResult]:
    """Run every spec (at most ``jobs`` at a time), fresh: an existing run dir is emptied.

    ``trainer`` is a training script (default: the example trainer, ``python -m gpt_trainer``).
    ``command_for(spec, run_dir)`` builds another host's command (default: :func:`build_command`
    for the example trainer); ``progress_file`` (relative to the run dir) gains one line per
    training step and drives the progress bar. Returns one :class:`RunResult` per spec, in the
    order of ``specs``.
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}.")
    env = run_environment(env_overrides)
    pending = list(enumerate(specs))
    active: dict[int, tuple[subprocess.Popen, float, str, object]] = {}
    results: dict[int, RunResult] = {}
    bar = progress_bar(sum(s.train_iters for s in specs), disable=not progress, desc=desc)
    done_steps: dict[int, int] = {}
    previous_handler = exit_on_sigterm()
    try:
        while pending or active:
            while pending and len(active) < jobs:
                index, spec = pending.pop(0)
                directory = run_dir(out_dir, spec)
                _fresh_dir(directory)
                cmd = command_for(spec, directory) if command_for else build_command(spec, directory, trainer)
                with open(os.path.join(directory, "command.txt"), "w", encoding="utf-8") as f:
                    f.write(shlex.join(cmd) + "\n")
                log = open(os.path.join(directory, "stdout.log"), "w", encoding="utf-8")
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                active[index] = (proc, time.monotonic(), directory, log)
                done_steps[index] = 0
            time.sleep(poll_s)
            for index in list(active):
                proc, start, directory, log = active[index]
                steps = min(_count_lines(os.path.join(directory, progress_file)), specs[index].train_iters)
                if proc.poll() is not None:
                    log.close()
                    steps = specs[index].train_iters  # finished (or stopped early): count it all
                    results[index] = RunResult(
                        specs[index], directory, proc.returncode, time.monotonic() - start,
                        tail_of(os.path.join(directory, "stdout.log")) if proc.returncode else "",
                    )
                    del active[index]
                bar.update(steps - done_steps[index])
                done_steps[index] = steps
                bar.set_postfix_str(f"running {len(active)}, done {len(results)}/{len(specs)}")
    finally:
        for proc, _, _, log in active.values():  # interrupted: stop our own children only
            proc.terminate()
            log.close()
        bar.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    return [results[i] for i in range(len(specs))]


def exit_on_sigterm():
    """Turn SIGTERM into ``SystemExit`` while runs are launched, so the ``finally`` above stops
    the children instead of leaving them orphaned. Returns the previous handler (None when not
    on the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _raise(signum, frame):  # noqa: ARG001 -- signal handler signature
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _raise)


def _fresh_dir(directory: str) -> None:
    """An empty ``directory`` (the trainer appends to its JSONL files, so old runs must go)."""
    if os.path.isdir(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
