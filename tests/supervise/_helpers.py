"""Run ``python -m mechmon_megatron.supervise`` as a real process; a local webhook server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_HOST = Path(__file__).with_name("_fake_host.py")


@dataclass
class Result:
    returncode: int
    output: str
    seconds: float


def supervise(options: Sequence[str], command: Sequence[str], timeout_s: float = 120.0,
              env: dict | None = None) -> Result:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                **(env or {})}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mechmon_megatron.supervise", *map(str, options), "--",
                           *map(str, command)], cwd=REPO_ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout_s)
    return Result(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start)


def records(save: Path) -> list[dict]:
    path = save / "mechmon_recovery.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tree(save: Path) -> dict[str, float]:
    """Every file under ``save`` except the supervisor's own log and the fake host's -> mtime."""
    skip = {"mechmon_recovery.jsonl", "launches.jsonl"}
    return {str(p.relative_to(save)): p.stat().st_mtime for p in save.rglob("*") if p.is_file() and p.name not in skip}


@dataclass
class Hook:
    """A webhook receiver on 127.0.0.1 (``delay_s``: answer that late; ``status``: answer code)."""

    delay_s: float = 0.0
    status: int = 200
    bodies: list = field(default_factory=list)

    def __enter__(self) -> Hook:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 -- http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.bodies.append(json.loads(body))
                time.sleep(hook.delay_s)
                self.send_response(hook.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def closed_port_url() -> str:
    """A URL nothing listens on (the port was free a moment ago)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/hook"
