"""One resumable trainer launch of the recovery study, and the trajectory its launches kept.

A launch is the example trainer started once with ``--save CK --metrics-jsonl metrics-L<k>.jsonl``.
Its start is written to ``launches.json`` before it runs and its end after, so a study killed
half-way (a session that ends hard) resumes a launch that had started from the newest checkpoint
it wrote itself (``--load CK --ckpt-step N``): the trainer is bit-identical when resumed (tested
in ``tests/megatron_core``), so the resumed launch trains the same steps it would have.

The kept trajectory of an operator: launch k's rows replace everything of the earlier launches
after launch k's first iteration (a rollback discards those steps); within one launch the last
row of an iteration wins (a resumed launch repeats the steps after its checkpoint).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from mechmon_megatron.research.study.runner import run_environment
from mechmon_megatron.supervise.checkpoints import list_checkpoints
from mechmon_megatron.supervise.command import parse_command, set_flag

STATE_FILE = "launches.json"


@dataclass
class LaunchRecord:
    index: int
    argv: list[str]
    start_iteration: int
    """Iterations done when the launch started (its checkpoint; 0 from scratch)."""
    started: float
    wall_s: float = 0.0
    """Seconds of every attempt of this launch (a resumed launch adds its attempts)."""
    returncode: Optional[int] = None
    stopped_at: Optional[int] = None
    """The iteration an operator stopped it at (a loss-spike rule), else None."""
    note: str = ""
    finished: bool = False

    def metrics_path(self, directory: str) -> str:
        return os.path.join(directory, f"metrics-L{self.index}.jsonl")


@dataclass
class LaunchState:
    directory: str
    launches: list[LaunchRecord] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    """Operator state that must survive a restart of the study (JSON)."""

    @classmethod
    def load(cls, directory: str) -> LaunchState:
        path = os.path.join(directory, STATE_FILE)
        if not os.path.exists(path):
            return cls(directory)
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        return cls(directory, [LaunchRecord(**r) for r in body["launches"]], body.get("extra", {}))

    def save(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, STATE_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"launches": [asdict(r) for r in self.launches], "extra": self.extra}, f, indent=1)
        os.replace(path + ".tmp", path)


def read_rows(path: str) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut by a kill
                        pass
    except FileNotFoundError:
        pass
    return rows


def kept_trajectory(state: LaunchState) -> dict[int, dict]:
    """Iteration -> metrics row of the trajectory the operator kept (see the module docstring)."""
    kept: dict[int, dict] = {}
    for launch in state.launches:
        kept = {i: r for i, r in kept.items() if i <= launch.start_iteration}
        for row in read_rows(launch.metrics_path(state.directory)):
            kept[int(row["iteration"])] = row
    return dict(sorted(kept.items()))


def _resume_point(ckpt_dir: str, launch: LaunchRecord) -> Optional[int]:
    """The newest checkpoint this launch wrote (after its start), for a resumed attempt."""
    mine = [c for c in list_checkpoints(ckpt_dir)
            if c.iteration > launch.start_iteration and _newest_mtime(c.path) > launch.started]
    return mine[-1].iteration if mine else None


def _newest_mtime(path: str) -> float:
    """Newest modification time of the files under a checkpoint folder (a save rewrites them)."""
    newest = 0.0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                newest = max(newest, os.path.getmtime(os.path.join(root, name)))
            except OSError:
                pass
    return newest


def run_launch(state: LaunchState, launch: LaunchRecord, ckpt_dir: str,
               watch: Optional[Callable[[LaunchRecord], Optional[int]]] = None, poll_s: float = 2.0) -> LaunchRecord:
    """Run ``launch`` to its end (resuming an attempt that a killed study left), record it.

    ``watch(launch)`` is polled while it runs: a step number stops the launch there (SIGTERM to
    its process group) and is recorded as ``stopped_at``."""
    if launch.finished:
        return launch
    if not any(known is launch for known in state.launches):
        state.launches.append(launch)
    argv = list(launch.argv)
    resume = _resume_point(ckpt_dir, launch)
    if resume is not None:
        command = parse_command(argv)
        host = set_flag(set_flag(command.host_args, "--load", [ckpt_dir]), "--ckpt-step", [str(resume)])
        argv = list(command.with_host_args(host).argv)
        launch.note = (launch.note + f" resumed at {resume};").strip()
    state.save()
    log_path = os.path.join(state.directory, f"stdout-L{launch.index}.log")
    start = time.monotonic()
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(argv, env=run_environment(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(poll_s)
                if watch is not None and launch.stopped_at is None:
                    step = watch(launch)
                    if step is not None:
                        launch.stopped_at = step
                        os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            launch.wall_s += time.monotonic() - start
            state.save()
            raise
    launch.wall_s += time.monotonic() - start
    launch.returncode = proc.returncode
    launch.finished = True
    state.save()
    return launch


def stdout_of(state: LaunchState, launch: LaunchRecord) -> str:
    try:
        with open(os.path.join(state.directory, f"stdout-L{launch.index}.log"), encoding="utf-8",
                  errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""
