"""Launch a script under real torchrun (``python -m torch.distributed.run``) for tests.

Picks a free rendezvous port, applies a timeout (the whole process group is killed when it
expires), and captures stdout+stderr together so failures are readable in the pytest report.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class TorchrunResult:
    returncode: int
    output: str
    timed_out: bool

    def check(self, expected_returncode: int = 0) -> TorchrunResult:
        if self.timed_out or self.returncode != expected_returncode:
            tail = self.output[-6000:]
            raise AssertionError(f"process exited with {self.returncode} (timed out: "
                                 f"{self.timed_out}, expected {expected_returncode}):\n{tail}")
        return self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | os.PathLike, args: Sequence[str], nproc: int = 2,
                 timeout_s: float = 120.0, env: Optional[dict[str, str]] = None) -> TorchrunResult:
    """Run ``torchrun --nproc-per-node nproc script args`` from the repository root.

    torchrun itself exits with 1 when a worker fails, whatever the worker's exit code; use
    :func:`run_python` to check a single process's own exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
           *map(str, args)]
    return _launch(cmd, timeout_s, env)


def run_torchrun_module(module: str, args: Sequence[str], nproc: int = 2, timeout_s: float = 120.0,
                        env: Optional[dict[str, str]] = None,
                        torchrun_args: Sequence[str] = ()) -> TorchrunResult:
    """Run ``torchrun [torchrun_args] --nproc-per-node nproc -m module args`` from the repository root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *map(str, args)]
    return _launch(cmd, timeout_s, env)


def run_python(script: str | os.PathLike, args: Sequence[str], timeout_s: float = 120.0,
               env: Optional[dict[str, str]] = None) -> TorchrunResult:
    """Run ``python script args`` (one process, no launcher) from the repository root."""
    return _launch([sys.executable, str(script), *map(str, args)], timeout_s, env)


def _launch(cmd: list[str], timeout_s: float, env: Optional[dict[str, str]]) -> TorchrunResult:
    return _finish(_start(cmd, env), timeout_s)


def run_ranks(script: str | os.PathLike, args: Sequence[str], nproc: int = 2, timeout_s: float = 120.0,
              env: Optional[dict[str, str]] = None) -> list[TorchrunResult]:
    """Start ``nproc`` ranks as plain processes with the rendezvous in the environment, as
    ``srun`` does without torchrun: nothing tears the job down when one rank exits, so a rank
    left waiting in a collective shows up as a timeout. Returns each rank's own result."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(env or {})}
        procs.append(_start([sys.executable, str(script), *map(str, args)], rank_env))
    # Read every rank's output concurrently: a full pipe would block a rank and look like a hang.
    with ThreadPoolExecutor(nproc) as pool:
        return list(pool.map(lambda p: _finish(p, timeout_s), procs))


def _start(cmd: list[str], env: Optional[dict[str, str]]) -> subprocess.Popen:
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                 full_env.get("PYTHONPATH")]))})
    full_env.update(env or {})
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout_s: float) -> TorchrunResult:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return TorchrunResult(proc.returncode, output, timed_out=False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and its children, started by us
        output, _ = proc.communicate()
        return TorchrunResult(proc.returncode, output, timed_out=True)
