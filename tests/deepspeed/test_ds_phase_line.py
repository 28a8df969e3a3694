"""The DeepSpeed example hands its learning-rate schedule to ``attach`` (warm-up, cosine decay and
``--lr``), so the early-phase correction's one start-up line names the job's peak learning rate:
here the test model's 1-step warm-up at 1e-3 against the shipped moments' 100-step warm-up at 2e-3,
at the schedule they were measured at (interval 20, delta 100), so the correction is off."""

from __future__ import annotations

import re

import pytest

from tests.deepspeed._ds_runs import run_example_ranks

PHASE_LINE = re.compile(r"\[mechmon\] detector: (.*early-phase correction.*)$", re.M)


@pytest.mark.distributed
def test_the_phase_line_names_the_jobs_peak_learning_rate(tmp_path):
    pytest.importorskip("deepspeed")
    result = run_example_ranks(["--train-iters", "101", "--mechmon-set=interval=20", "--mechmon-set=delta=100",
                                "--monitor-dir", tmp_path / "mon"], nproc=1, timeout_s=300)[0]
    assert result.returncode == 0 and not result.timed_out, result.output[-4000:]
    lines = PHASE_LINE.findall(result.output)
    assert len(lines) == 1, result.output[-4000:]
    assert "measured with a 100-step warm-up, cosine decay, peak learning rate 0.002" in lines[0]
    assert "this job has a 1-step warm-up, cosine decay, peak learning rate 0.001" in lines[0]
    assert "the early-phase correction is off" in lines[0]
