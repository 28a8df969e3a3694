"""``mechmon-plan`` says what it measures while it measures: on stderr, the report on stdout as before."""

from __future__ import annotations

import json
import subprocess
import sys

# The smallest measurement of a preset: llama3-8b at TP 8 without the whole-layer dW (one layer's
# 4 heads and one snapshot copy), each unit timed once.
ARGS = ["--model", "llama3-8b", "--tp", "8", "--no-full-matrix-dw", "--repeats", "0", "--threads", "1", "--json"]


def _plan(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mechmon_megatron.plan.cli", *ARGS, *extra], capture_output=True,
                          text=True, timeout=300)


def _shape(value):
    """Keys all the way down (lists by their first item): the report's shape, not its numbers."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def test_the_measurement_reports_progress_on_stderr_and_keeps_the_json():
    measured = _plan()
    assert measured.returncode == 0, measured.stderr
    lines = measured.stderr.splitlines()
    announced = [line for line in lines if "kernel units" in line]
    assert len(announced) == 1, measured.stderr
    first = announced[0]
    assert first.startswith("[mechmon] mechmon-plan: measuring 2 kernel units on cpu (attn_heads, snapshot_copy; "
                            "one timed call each): roughly ")
    assert "--no-measure skips this" in first
    assert any(line.startswith("[mechmon] mechmon-plan: measuring 1/2: check_heads") for line in lines)
    assert any(line.startswith("[mechmon] mechmon-plan: measuring 2/2: one snapshot copy") for line in lines)
    assert lines[-1].startswith("[mechmon] mechmon-plan: measured in ")
    report = json.loads(measured.stdout)  # stdout is the report alone
    assert report["check_time_s_per_rank"]["components"]["attn_heads"]["label"] == "measured"

    estimated = _plan("--no-measure")
    assert estimated.returncode == 0 and "kernel units" not in estimated.stderr, estimated.stderr
    reference = json.loads(estimated.stdout)
    shape, want = _shape(report), _shape(reference)
    # The same keys everywhere; only the labels' values (measured / estimated) and texts differ.
    assert shape.keys() == want.keys()
    assert shape["check_time_s_per_rank"]["components"].keys() == want["check_time_s_per_rank"]["components"].keys()
