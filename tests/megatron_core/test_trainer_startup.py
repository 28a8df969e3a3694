"""The real example trainer (``python -m gpt_trainer``): never silently unmonitored.

* ``--mechmon-*`` flags without ``--mechmon`` stop the parse (exit 2, one line naming them);
* a webhook URL that could never be posted to stops the parse, before the model is built;
* a scalar writer that fails during the run never changes the exit code of a run that trained to
  its end: one line on the writer rank says how many record writes failed and where.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.megatron_core._torchrun import REPO_ROOT

pytest.importorskip("megatron.core")

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--ffn-hidden-size", "64", "--micro-batch-size", "2", "--corpus-max-bytes", "200000", "--seed", "3"]
TRAINER = [sys.executable, "-m", "gpt_trainer"]


def _trainer(cwd: Path, *args: str, timeout_s: float = 180) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    proc = subprocess.run([*TRAINER, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - start


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if ": error: " in line]


def _refused_at_parse_time(proc: subprocess.CompletedProcess, seconds: float) -> None:
    """Exit 2 from argparse, with nothing of the run started (no model, no step, no traceback)."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "cpu compat" not in output and "iteration " not in output, output[-3000:]
    assert seconds < 60, seconds  # a parse, not a model build (about 1.5 s on an idle 2-core machine)


def test_mechmon_flags_without_the_switch_exit_2_naming_them(tmp_path: Path):
    proc, seconds = _trainer(tmp_path, *TINY, "--train-iters", "3", "--mechmon-interval", "5", "--mechmon-action",
                             "log")
    _refused_at_parse_time(proc, seconds)
    assert _error_lines(proc) == ["__main__.py: error: --mechmon-interval, --mechmon-action given without --mechmon: "
                                  "add --mechmon to monitor, or drop them"], proc.stderr[-2000:]


@pytest.mark.parametrize("url", ["http://", "http://:80/x"])
def test_unusable_webhook_exits_2_before_the_model_is_built(tmp_path: Path, url: str):
    proc, seconds = _trainer(tmp_path, *TINY, "--train-iters", "3", "--mechmon", "--mechmon-alert-webhook", url)
    _refused_at_parse_time(proc, seconds)
    errors = _error_lines(proc)
    assert len(errors) == 1 and errors[0].startswith("__main__.py: error: --mechmon-alert-webhook must be an "
                                                     "http:// or https:// URL"), proc.stderr[-2000:]


def test_failing_records_file_never_changes_the_exit_code(tmp_path: Path):
    """``mechmon_scalars.jsonl`` is a link to /dev/full: the folder passes the start-up probe, and
    every flush of the records file fails with ENOSPC from the first check on (as root too, where
    a read-only folder would not stop the writes). Training goes on to --train-iters, the run
    exits 0, and the writer rank says once, at the end, that the records are incomplete."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    log_dir = tmp_path / "mechmon"
    log_dir.mkdir()
    (log_dir / "mechmon_scalars.jsonl").symlink_to("/dev/full")
    proc, _ = _trainer(tmp_path, *TINY, "--train-iters", "12", "--mechmon", "--mechmon-interval", "5",
                       "--mechmon-delta", "5", "--mechmon-log-dir", str(log_dir))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert re.search(r"iteration\s+12/\s+12", output), output[-4000:]  # trained to the end
    assert "phase write" in output  # the failure at the check was counted, as before
    ends = re.findall(r"\[mechmon\] (\d+) record writes failed \(first: rank 0, iteration 5, phase write: "
                      r"OSError: \[Errno 28\] No space left on device\): records in (\S+) are incomplete", output)
    assert len(ends) == 1, output[-4000:]
    count, where = ends[0]
    assert int(count) >= 2 and where == str(log_dir), ends  # the checks at 5 and 10, and the close
