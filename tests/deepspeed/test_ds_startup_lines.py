"""DeepSpeed's ``attach`` prints the start-up lines the example trainer prints, through the same
functions (``session/startup.py``: ``log_startup_warnings``, ``log_monitoring``), on rank 0 only.

The DeepSpeed example (one process) and ``python -m gpt_trainer`` (a megatron-core GPT-MoE of the
same depth and router count) run with the same schedule; a delta of five intervals makes the
start-up check warn about the snapshot sets held at once.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mechmon_megatron.session.config import MechmonConfig
from tests.deepspeed._ds_runs import run_example_ranks
from tests.megatron_core._torchrun import REPO_ROOT

SCHEDULE = {"interval": 2, "delta": 10}
MONITORING = re.compile(r"^INFO mechmon_megatron\.session\.startup: (\[mechmon\] monitoring .*)$", re.M)
SNAPSHOT_SETS = re.compile(r"^WARNING mechmon_megatron\.session\.startup: (\[mechmon\] .* snapshot sets of the Q/K "
                           r"weights are held at once)", re.M)
TRAINER_MOE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
               "--ffn-hidden-size", "64", "--micro-batch-size", "2", "--corpus-max-bytes", "200000", "--seed", "3",
               "--num-experts", "4", "--moe-router-topk", "2"]


def _flag_names(line: str) -> str:
    """DeepSpeed names the keys (``ds_config.mechmon.delta``) where the trainer names the flags."""
    return re.sub(r"ds_config\.mechmon\.([a-z0-9_]+)", lambda m: "--mechmon-" + m.group(1).replace("_", "-"), line)


@pytest.mark.distributed
def test_deepspeed_prints_the_trainers_start_up_lines(tmp_path: Path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    sets = [f"--mechmon-set={key}={value}" for key, value in SCHEDULE.items()]
    deepspeed = run_example_ranks(["--train-iters", "2", *sets, "--monitor-dir", tmp_path / "mon"], nproc=1)[0]
    assert deepspeed.returncode == 0 and not deepspeed.timed_out, deepspeed.output[-4000:]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    trainer = subprocess.run(
        [sys.executable, "-m", "gpt_trainer", *TRAINER_MOE, "--train-iters", "10", "--mechmon",
         "--mechmon-interval", str(SCHEDULE["interval"]), "--mechmon-delta", str(SCHEDULE["delta"])],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert trainer.returncode == 0, (trainer.stdout + trainer.stderr)[-4000:]
    trainer_out = trainer.stdout + trainer.stderr

    expected = "[mechmon] monitoring 2 attention layers and 2 routers on rank 0 (interval 2, delta 10, action warn)"
    assert MONITORING.findall(deepspeed.output) == [expected], deepspeed.output[-4000:]
    assert MONITORING.findall(trainer_out) == [expected], trainer_out[-4000:]
    # The same start-up warning, with DeepSpeed's key names (the trainer goes on with the memory
    # it estimates from its model flags).
    ours, theirs = SNAPSHOT_SETS.findall(deepspeed.output), SNAPSHOT_SETS.findall(trainer_out)
    assert len(ours) == 1 and ours[0].startswith("[mechmon] ds_config.mechmon.delta 10 / ds_config.mechmon.interval "
                                                 "2: 5 snapshot sets"), deepspeed.output[-4000:]
    assert [_flag_names(ours[0])] == theirs, (ours, theirs, trainer_out[-4000:])


def test_start_up_lines_are_rank_0_only(caplog):
    from mechmon_megatron.adapters.deepspeed.config import key_of
    from mechmon_megatron.detect.config_error import ConfigNote
    from mechmon_megatron.session.startup import StartupReport, log_monitoring, log_startup_warnings

    caplog.set_level(logging.INFO, logger="mechmon_megatron")
    config = MechmonConfig(enabled=True)
    report = StartupReport(warnings=[ConfigNote("delta", "500 / $interval 100: held at once")])
    for rank in (1, 3):
        log_startup_warnings(report, rank)
        log_monitoring(config, 0, 0, rank)
    assert caplog.records == []
    log_startup_warnings(report, 0, spell=key_of)
    log_startup_warnings(report, 0)  # the command line's spelling
    log_monitoring(config, 0, 1, 0, attention_kind="self-attention (q_proj/k_proj)")
    assert [r.getMessage() for r in caplog.records] == [
        "[mechmon] ds_config.mechmon.delta 500 / ds_config.mechmon.interval 100: held at once",
        "[mechmon] --mechmon-delta 500 / --mechmon-interval 100: held at once",
        "[mechmon] no self-attention (q_proj/k_proj) found on rank 0: attention monitors idle there",
        "[mechmon] monitoring 0 attention layers and 1 routers on rank 0 (interval 100, delta 100, action warn)",
    ]
