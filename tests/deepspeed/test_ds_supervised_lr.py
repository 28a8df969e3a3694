"""mechmon-supervise around the DeepSpeed example (one rank under torchrun): a drill aborts at 6,
the rollback is ``global_step4`` (``--select-flag=--ckpt-tag``), the policy halves ``--lr``, and
the relaunch trains with half the first launch's LR at every iteration: the supervisor adds
``--override-opt_param-scheduler``, which keeps DeepSpeed's restored scheduler step and takes the
peak LR from the flag (without it the checkpoint's ``LambdaLR.base_lrs`` would win)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from tests.deepspeed._ds_runs import ENV, MODEL, SCRIPT
from tests.megatron_core._torchrun import free_port
from tests.supervise._helpers import records, supervise

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

_LR_LINE = re.compile(r"^iter (\d+) loss \S+ lr (\S+) ", re.M)


def _lr_by_launch(output: str) -> list[dict[int, float]]:
    """The example's ``iter N ... lr X`` lines (the LR after step N), split where N restarts."""
    launches: list[dict[int, float]] = []
    last = None
    for step, lr in _LR_LINE.findall(output):
        if last is None or int(step) <= last:
            launches.append({})
        launches[-1][int(step)] = float(lr)
        last = int(step)
    return launches


def test_lr_remedy_takes_effect_after_a_rollback_to_a_deepspeed_checkpoint(tmp_path: Path):
    save, monitor = tmp_path / "ckpt", tmp_path / "mon"
    config = json.loads((SCRIPT.parent / "ds_config_mechmon.json").read_text())
    config["mechmon"].update(interval=2, delta=2, action="checkpoint-and-abort")
    (tmp_path / "ds.json").write_text(json.dumps(config))
    # the drill is the one --mechmon-set of the command: the remedy removes it with the halved LR
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"version": 1, "families": {"drill": "drill"}, "remedies": {"drill": [
        {"name": "half-lr", "alternatives": [{"remove": ["--mechmon-set"], "scale": {"--lr": 0.5}}]}]}}))
    model = list(MODEL)
    model[model.index("--log-interval") + 1] = "1"  # every step's LR is printed
    model[model.index("--lr-warmup-iters") + 1] = "3"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(SCRIPT), *model, "--train-iters", "8", "--save", str(save),
               "--save-interval", "2", "--monitor-dir", str(monitor), "--deepspeed-config", str(tmp_path / "ds.json"),
               "--mechmon-set", "drill_at=6"]
    out = supervise(["--policy", policy, "--select-flag=--ckpt-tag"], command, timeout_s=400, env=ENV)
    assert out.returncode == 0, out.output[-5000:]
    relaunch = records(save)[0]
    assert relaunch["checkpoint"]["name"] == "global_step4", relaunch
    assert "--override-opt_param-scheduler" in relaunch["flags_added"], relaunch
    assert "--override-opt_param-scheduler: peak LR from --lr 0.0005" in out.output, out.output[-3000:]
    # the drill aborts inside step 6, before its line: the first launch printed 1-5
    first, second = _lr_by_launch(out.output)
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(second) == [5, 6, 7, 8], (first, second)
    # printed with 4 significant digits: the same step of the same schedule at half the peak
    assert second[5] == pytest.approx(0.5 * first[5], rel=2e-3), (first, second)
    factor = _example().lr_lambda(argparse.Namespace(lr=1e-3, min_lr=None, lr_warmup_iters=3, train_iters=8))
    for step in (5, 6, 7, 8):  # the LR after step N, for the scheduler's step N
        assert second[step] == pytest.approx(0.5e-3 * factor(step), rel=2e-3), (step, second)


def _example():
    spec = importlib.util.spec_from_file_location("_ds_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
