"""mechmon-supervise around megatron-core's own training loop (``megatron.training.pretrain``, the
current leg: megatron-core >= 0.18 ships it) with the provider script on two gloo ranks: a drill
aborts at 20, the rollback is ``iter_0000010``, the policy halves ``--lr``. The supervisor reads
the release's own parser (``--help``), finds ``--override-opt_param-scheduler`` there and adds it,
and the relaunch trains with half the LR (TensorBoard's ``learning-rate`` read back): without the
switch Megatron's scheduler state and the optimizer's per-group ``max_lr`` from the checkpoint
would keep the first launch's LR."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from tiny_gpt_flags import TINY_GPT_MOE

from tests.megatron_core._torchrun import free_port
from tests.megatron_lm.test_core_training_loop import CPU_LAUNCHER, ENV, SCRIPT, TP2
from tests.supervise._helpers import records, supervise

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.training") is None,
        reason="megatron.training ships with megatron-core >= 0.18 (make test-current)",
    ),
]


def _learning_rates(tb_dir: str) -> list[dict[int, float]]:
    """``learning-rate`` by step, one dict per events file (one per launch), oldest first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")), key=os.path.getmtime):
        events = EventAccumulator(path, size_guidance={"scalars": 0})
        events.Reload()
        if "learning-rate" in events.Tags()["scalars"]:
            out.append({e.step: e.value for e in events.Scalars("learning-rate")})
    return out


def test_lr_remedy_takes_effect_in_megatron_core_training_loop(tmp_path):
    save, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"version": 1, "families": {"drill": "drill"}, "remedies": {"drill": [
        {"name": "half-lr", "alternatives": [{"remove": ["--mechmon-drill-at"],
                                              "scale": {"--lr": 0.5, "--min-lr": 0.5}}]}]}}))
    model = list(TINY_GPT_MOE)
    model[model.index("--save-interval") + 1] = "10"
    model[model.index("--log-interval") + 1] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", CPU_LAUNCHER, SCRIPT, *model, *TP2,
               "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--train-iters", "26",
               "--save", save, "--tensorboard-dir", tb, "--mechmon-action", "checkpoint-and-abort",
               "--mechmon-drill-at", "20"]
    out = supervise(["--policy", policy], command, timeout_s=900, env=ENV)
    assert out.returncode == 0, out.output[-6000:]
    relaunch = records(Path(save))[0]
    assert relaunch["checkpoint"]["name"] == "iter_0000010", relaunch
    assert "--override-opt_param-scheduler" in relaunch["flags_added"], relaunch
    first, second = _learning_rates(tb)
    assert max(first) == 20 and min(second) == 11 and max(second) == 26, (first, second)
    for step in range(11, 21):
        assert second[step] == pytest.approx(0.5 * first[step], rel=1e-6), (step, first, second)
