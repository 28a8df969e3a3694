"""megatron-core's own training loop (``megatron.training.pretrain``, megatron-core >= 0.18: the
current leg) on multi-head latent attention and QK-norm models, started the zero-patch way
(``mechmon-run`` through the CPU launcher) under torchrun, two gloo ranks, tensor parallel 2 with
sequence parallelism: every head of every layer has its Delta2 scalar (MLA: also the whole
stream), nothing is left out, no monitor phase fails. The values themselves are checked against
dense references in ``tests/megatron_core/test_qk_norm_and_mla_sites.py`` and across layouts in
``tests/megatron_core/test_mechmon_parallel.py``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
from tiny_gpt_flags import FRONTIER_ATTENTION, TINY_GPT_MOE

from tests.megatron_core._torchrun import REPO_ROOT, run_torchrun_module

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.training") is None,
        reason="megatron.training ships with megatron-core >= 0.18 (make test-current)",
    ),
]

SCRIPT = str(REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_core.py")
CPU_LAUNCHER = "mechmon_megatron.testing.megatron_lm_cpu"
ENV = {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@pytest.mark.parametrize("variant", sorted(FRONTIER_ATTENTION))
def test_every_head_is_monitored_under_tensor_parallelism(tmp_path, variant):
    log_dir = tmp_path / "mechmon"
    args = [SCRIPT, *TINY_GPT_MOE, *FRONTIER_ATTENTION[variant], "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--train-iters", "11", "--mechmon-per-head-scalars", "--mechmon-log-dir", log_dir]
    result = run_torchrun_module(CPU_LAUNCHER, args, nproc=2, timeout_s=300, env=ENV).check()
    assert "monitoring 2 attention layers" in result.output and "leave out" not in result.output
    problems = [line for line in result.output.splitlines()
                if "[mechmon]" in line and ("fail" in line or "error" in line)]
    assert not problems, problems
    with open(os.path.join(log_dir, "mechmon_scalars.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [5, 10]
    wanted = [f"mechmon/attn/delta2_entropy/layer_{layer}/head_{head}" for layer in (1, 2) for head in range(4)]
    wanted += [f"mechmon/attn/dw_entropy/layer_{layer}" for layer in (1, 2)]
    if variant == "mla":
        wanted += [f"mechmon/attn/delta2_whole_entropy/layer_{layer}/head_{head}" for layer in (1, 2)
                   for head in range(4)]
    for row in rows:
        for name in wanted:
            assert name in row["scalars"], sorted(row["scalars"])
            assert math.isfinite(row["scalars"][name]) and row["scalars"][name] > 0
