"""Monitor values on multi-head latent attention (MLA) and QK-norm models are the same under
TP / PP / EP layouts as in a single process (real torchrun, gloo).

The example trainer runs with its weights after every step set by the step number alone
(``_set_weights_driver.py``: ``W(t) = W(0) + t * 1e-2 * N_name``, the same for every layout,
norm gammas included), so the monitors read the same weights everywhere and the scalars the writer
wrote at the check of step 2 (window 1) must agree within 1e-6 relative: what is compared is the
adapter's reads (TP head split, the gather of a row-split MLA down projection, QK-norm gammas,
stage-local layers) and the session's reductions, not megatron-core's training. Every scalar the
single-process run wrote must be there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.megatron_core._torchrun import REPO_ROOT, run_python, run_torchrun

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.distributed

DRIVER = REPO_ROOT / "tests" / "megatron_core" / "_set_weights_driver.py"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--num-experts", "4", "--moe-router-topk", "2",
         "--use-cpu-initialization", "--seed", "7", "--lr", "1e-3", "--corpus-max-bytes", "200000",
         "--attention-backend", "torch", "--train-iters", "2"]
VARIANTS = {
    "mla": ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
            "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm"],
    "qk_norm": ["--qk-layernorm", "--num-query-groups", "2"],
}
MECHMON = ["--mechmon", "--mechmon-interval", "1", "--mechmon-delta", "1", "--mechmon-action", "log",
           "--mechmon-per-head-scalars"]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
LAYOUTS = {"tp2_sp": [*TP2, "--sequence-parallel"], "pp2": ["--pipeline-model-parallel-size", "2"],
           "ep2": ["--expert-model-parallel-size", "2"]}  # MoE under TP needs sequence parallelism


def _scalars(log_dir: Path, step: int) -> dict[str, float]:
    with open(log_dir / "mechmon_scalars.jsonl", encoding="utf-8") as f:
        return next(row["scalars"] for row in map(json.loads, f) if row["step"] == step)


def _run(tmp: Path, variant: str, layout: str) -> dict[str, float]:
    log_dir = tmp / f"{variant}_{layout}"
    args = [*MODEL, *VARIANTS[variant], *LAYOUTS.get(layout, []), *MECHMON, "--mechmon-log-dir", log_dir]
    if layout == "single":
        run_python(DRIVER, args, timeout_s=150).check()
    else:
        run_torchrun(DRIVER, args, nproc=2, timeout_s=200).check()
    return _scalars(log_dir, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("frontier_layouts")


@pytest.fixture(scope="module")
def references(runs) -> dict[str, dict[str, float]]:
    return {variant: _run(runs, variant, "single") for variant in VARIANTS}


CASES = [("mla", "tp2_sp"), ("mla", "pp2"), ("qk_norm", "tp2_sp"), ("qk_norm", "pp2"),
         ("mla", "ep2")]
FAST = {("mla", "tp2_sp"), ("qk_norm", "tp2_sp")}


@pytest.mark.parametrize("variant,layout", [pytest.param(v, lay, marks=[] if (v, lay) in FAST else [pytest.mark.slow])
                                            for v, lay in CASES])
def test_layout_matches_single_process(runs, references, variant, layout):
    reference = {k: v for k, v in references[variant].items() if k.startswith("mechmon/attn/")}
    got = _run(runs, variant, layout)
    assert reference and len([k for k in reference if "/head_" in k]) >= 8
    missing = sorted(set(reference) - set(got))
    assert not missing, missing
    worst = max((abs(got[k] - v) / max(abs(v), 1e-12), k) for k, v in reference.items())
    assert worst[0] <= 1e-6, worst
