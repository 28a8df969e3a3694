"""Checkpoint-and-abort drill on a real 2-process megatron-core job, then resume with detector state."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.megatron_core._torchrun import REPO_ROOT, run_torchrun

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_mechmon.py"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--num-experts", "4", "--moe-router-topk", "2", "--pipeline-model-parallel-size", "2",
         "--use-cpu-initialization", "--seed", "3", "--corpus-max-bytes", "200000", "--train-iters", "30"]
MECHMON = ["--mechmon", "--mechmon-interval", "5", "--mechmon-delta", "5", "--mechmon-exit-code", "42"]


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_drill_checkpoint_abort_then_resume(tmp_path: Path):
    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    common = [*MODEL, *MECHMON, "--save", save, "--save-interval", "10", "--tensorboard-dir", tb]
    drill = run_torchrun(SCRIPT, [*common, "--mechmon-drill-at", "20", "--mechmon-action", "checkpoint-and-abort"],
                         nproc=2, timeout_s=240)
    # torchrun itself exits 1 when a worker fails, and SIGTERMs (-15) the workers still running
    # once the first one has exited; its failure summary lists each failed worker's code.
    assert drill.returncode != 0 and not drill.timed_out, drill.output[-3000:]
    codes = [int(c) for c in re.findall(r"exitcode\s+:\s+(-?\d+)", drill.output)]
    assert 42 in codes and set(codes) <= {42, -15}, (codes, drill.output[-3000:])

    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    iter20 = save / "iter_0000020"
    assert sorted(p.name for p in (iter20 / "mechmon_extra").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    alert = json.loads((iter20 / "mechmon_alert.json").read_text())
    assert alert["iteration"] == 20 and alert["family"] == "drill" and alert["exit_code"] == 42
    assert alert["last_checkpoint_before_first_warning"]["iteration"] == 10

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("mechmon/attn/delta2_entropy/layer_1", "mechmon/attn/delta2_entropy/layer_2",
                "mechmon/attn/dw_entropy/layer_2", "mechmon/router/token_entropy/layer_1",
                "mechmon/router/weight_similarity/layer_2", "mechmon/router/eps/layer_1",
                "mechmon/alarm", "mechmon/overhead_ms", "lm loss"):
        assert tag in tags, tag
    assert max(e.value for e in acc.Scalars("mechmon/alarm") if e.step == 20) == 1.0

    resumed = run_torchrun(SCRIPT, [*common, "--load", save], nproc=2, timeout_s=240)
    resumed.check(0)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    # The writer rank (last rank) holds the detectors: its state at 30 counts the checks before
    # the abort (5..20) and after the resume (25, 30) -- the baseline was restored, not re-warmed.
    extra = torch.load(save / "iter_0000030" / "mechmon_extra" / "rank_00001.pt", weights_only=False)
    detector = extra["callbacks"]["mechmon"]["detector"]
    trends = {(f, layer, member): values for f, layer, member, values in detector["trends"]}
    assert ("attn_delta2", 1, "head_0") in trends
    # routers are judged at every check (5..30): 6 values; attention misses the check after the
    # resume (no t - delta snapshot at 25): 5
    assert max(len(v) for v in trends.values()) == 6, {k: len(v) for k, v in trends.items()}
