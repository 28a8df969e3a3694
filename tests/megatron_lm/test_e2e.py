"""End to end: Megatron-LM's own pretrain_gpt.py on CPU, both ways (opt-in).

``launch=patch``: a copy patched by ``mechmon-patch``, run by the CPU launcher with ``--launch
patch`` (the script's own ``mechmon.install()``); ``launch=run``: an unmodified copy, run by the
CPU launcher's default ``--launch run`` (``mechmon-run`` plus the CPU layer).

Needs a Megatron-LM checkout (core_v0.16.1 with Python 3.11 and core_v0.19.0 with Python 3.12
tested, docs/MEGATRON_LM.md): ``MEGATRON_LM_DIR=/path/to/Megatron-LM MECHMON_SLOW=1 pytest
tests/megatron_lm/test_e2e.py`` (``-k run`` or ``-k patch`` for one way). Packages Megatron-LM
imports beyond the project's (six, regex, pyyaml, pydantic, psutil, triton on 0.16.1; six,
regex, pyyaml on 0.19.0 in the current venv) may live in a separate directory named by
``MECHMON_E2E_PYTHONPATH``. The checkout is
copied; it is never modified.

Two ranks (gloo, plain processes so each rank's exit code is visible), a tiny GPT-MoE on mock
data, ``--mechmon-drill-at 20 --mechmon-action checkpoint-and-abort``; then a resume to 30. And
the same model with multi-head latent attention and with QK-norm under tensor parallelism: every
head monitored.
"""

from __future__ import annotations

import glob
import json
import math
import os
import socket
import subprocess
import sys

import pytest
from checkout_utils import copy_checkout
from tiny_gpt_flags import FRONTIER_ATTENTION, TINY_GPT_MOE

from mechmon_megatron.adapters.megatron_lm import patch_tool as mp
from tests.megatron_core._dist_state import saved_state, shard_keys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
WORLD = 2
CPU_LAUNCH = [sys.executable, "-m", "mechmon_megatron.testing.megatron_lm_cpu"]  # pretrain_gpt.py on CPU
LAUNCHES = ("patch", "run")
EXIT_CODE = 42

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(
        not MEGATRON_LM_DIR, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout to run the end-to-end test"
    ),
]



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=LAUNCHES)
def checkout(request, tmp_path_factory):
    """A copy of the checkout (sources only), patched for ``launch=patch``, unmodified for
    ``launch=run``, with the dataset helpers available; returns (root, launch)."""
    root = str(tmp_path_factory.mktemp(f"megatron_lm_{request.param}") / "Megatron-LM")
    copy_checkout(MEGATRON_LM_DIR, root, patch=request.param == "patch")
    assert mp.check(root).overall == ("applied" if request.param == "patch" else "not applied")
    return root, request.param


def launch(checkout, workdir: str, extra: list[str], tag: str) -> tuple[list[int], str]:
    """Start WORLD ranks of pretrain_gpt.py as torchrun would; return exit codes and rank 0+last logs."""
    checkout, how = checkout
    env = dict(os.environ)
    paths = [checkout, REPO] + [p for p in os.environ.get("MECHMON_E2E_PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        PYTHONPATH=os.pathsep.join(paths), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # Megatron requires it with tensor parallelism, on CPU too
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
    )
    common = TINY_GPT_MOE + ["--save", os.path.join(workdir, "ckpt"), "--tensorboard-dir", os.path.join(workdir, "tb")]
    procs, logs = [], []
    for rank in range(WORLD):
        log = os.path.join(workdir, f"{tag}_rank{rank}.log")
        logs.append(log)
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    CPU_LAUNCH + ["--launch", how, "pretrain_gpt.py"] + common + extra,
                    cwd=checkout,
                    env=rank_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "".join(open(log).read() for log in logs)
    return codes, text


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


def test_drill_checkpoints_aborts_and_resumes(checkout, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir = str(tmp_path)
    codes, log = launch(checkout, workdir, ["--train-iters", "30", "--mechmon-drill-at", "20",
                                            "--mechmon-action", "checkpoint-and-abort",
                                            "--mechmon-exit-code", str(EXIT_CODE)], "abort")
    assert codes == [EXIT_CODE] * WORLD, _tail(log)

    ckpt = os.path.join(workdir, "ckpt")
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "20"
    iter_dir = os.path.join(ckpt, "iter_0000020")
    for rank in range(WORLD):  # torch_dist: every rank wrote its shard files
        assert glob.glob(os.path.join(iter_dir, f"__{rank}_*.distcp")), os.listdir(iter_dir)
    assert set(os.listdir(ckpt)) == {"iter_0000020", "latest_checkpointed_iteration.txt"}  # the abort save only
    alert = json.load(open(os.path.join(iter_dir, "mechmon_alert.json")))
    assert alert["iteration"] == 20 and alert["family"] == "drill" and alert["exit_code"] == EXIT_CODE
    assert alert["checkpoint_dir"] == iter_dir
    # every rank's own mechmon state, its shard of the one "mechmon" entry inside the checkpoint
    assert shard_keys(iter_dir) == [f"mechmon/shard_{rank}_{WORLD}" for rank in range(WORLD)]
    for rank in range(WORLD):
        assert saved_state(iter_dir, rank, WORLD)["version"] == 2
    assert not os.path.exists(os.path.join(iter_dir, "mechmon_state"))

    events = EventAccumulator(
        glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))[0], size_guidance={"scalars": 0}
    )
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in (
        "mechmon/attn/delta2_entropy/layer_1",
        "mechmon/router/token_entropy/layer_2",
        "mechmon/alarm",
        "lm loss",
    ):
        assert name in tags, sorted(tags)
    assert max(e.value for e in events.Scalars("mechmon/alarm") if e.step == 20) == 1.0

    codes, log = launch(checkout, workdir, ["--train-iters", "30", "--load", ckpt], "resume")
    assert codes == [0] * WORLD, _tail(log)
    assert "restored detector state from" in log and "iteration       30/      30" in log
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "30"


@pytest.mark.parametrize("variant", sorted(FRONTIER_ATTENTION))
def test_frontier_attention_is_monitored(checkout, tmp_path, variant):
    """Multi-head latent attention and QK-norm models (tensor parallel 2 with sequence parallelism):
    every head of every layer has its Delta2 scalar in TensorBoard, MLA also its whole stream;
    no layer is left out and no monitor phase fails."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir = str(tmp_path)
    extra = [*FRONTIER_ATTENTION[variant], "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--train-iters", "11", "--mechmon-per-head-scalars"]
    codes, log = launch(checkout, workdir, extra, variant)
    assert codes == [0] * WORLD, _tail(log)
    assert "monitoring 2 attention layers" in log and "leave out" not in log, _tail(log)
    assert "[mechmon] done: 2 checks this launch" in log
    problems = [line for line in log.splitlines() if "[mechmon]" in line and ("fail" in line or "error" in line)]
    assert not problems, problems
    events = EventAccumulator(glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))[0],
                              size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    wanted = [f"mechmon/attn/delta2_entropy/layer_{layer}/head_{head}" for layer in (1, 2) for head in range(4)]
    if variant == "mla":
        wanted += [f"mechmon/attn/delta2_whole_entropy/layer_{layer}" for layer in (1, 2)]
    for name in wanted:
        assert name in tags, sorted(tags)
        assert [e.step for e in events.Scalars(name)] == [5, 10]
        assert all(math.isfinite(e.value) and e.value > 0 for e in events.Scalars(name))
