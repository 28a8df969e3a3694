"""The example trainer's attention variants (``gpt_trainer/attention_variants.py``) on CPU, one process:
multi-head latent attention (with and without a query latent) and per-head QK-norm GQA, with MoE,
under the study's core-attention backends (``torch``, ``emulated-lowp-fa``); the emulated FA fault
acts on MLA; the layout-independent init gives the MLA latent norms gamma = 1; the flags build the
megatron-core configs they name, and the combinations that would train wrongly are refused.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from tests.megatron_core._torchrun import REPO_ROOT, run_python

pytest.importorskip("megatron.core")

TINY_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--num-experts", "4", "--moe-router-topk", "2", "--lr", "3e-3",
            "--train-iters", "5", "--corpus-max-bytes", "200000", "--seed", "11", "--use-cpu-initialization"]
# d_qk = 16 + 8 = 24 differs from d_v = 8: the backends' separate head dims are exercised.
MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
       "--v-head-dim", "8"]
MLA_Q_LATENT = [*MLA, "--q-lora-rank", "32", "--qk-layernorm"]
QK_NORM = ["--qk-layernorm", "--num-query-groups", "2"]
EMULATED = ["--attention-backend", "emulated-lowp-fa"]
FAULT_ONSET = 3

# The trainer with a callback that writes every norm parameter's (min, max) after the init.
DRIVER = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {trainer_dir!r})
    from gpt_trainer import main

    class NormRecorder:
        name = "norms"

        def __init__(self, args):
            self.out = args.norms_out

        def on_train_start(self, ctx):
            norms = {{n: [p.min().item(), p.max().item()] for n, p in ctx.model_chunks[0].module.named_parameters()
                     if "norm" in n}}
            with open(self.out, "w") as f:
                json.dump(norms, f)

    def provider(parser):
        parser.add_argument_group("test").add_argument("--norms-out", required=True)
        return parser

    if __name__ == "__main__":
        sys.exit(main(extra_args_providers=[provider], callbacks_factory=lambda a: [NormRecorder(a)]))
''')


def _train(tmp: Path, name: str, flags: list[str]) -> tuple[list[dict], dict]:
    """Train ``TINY_MOE + flags``; (metrics rows, norm parameters' (min, max) after the init)."""
    script = tmp / "driver.py"
    if not script.exists():
        script.write_text(DRIVER.format(trainer_dir=str(REPO_ROOT / "examples" / "pretrain_scripts")))
    metrics, norms = tmp / f"{name}.jsonl", tmp / f"{name}.norms.json"
    run_python(script, [*TINY_MOE, *flags, "--metrics-jsonl", metrics, "--norms-out", norms], timeout_s=150).check()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return rows, json.loads(norms.read_text())


def _assert_trains(rows: list[dict]) -> None:
    losses = [row["lm_loss"] for row in rows]
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(x) for x in losses) and all(math.isfinite(row["grad_norm"]) for row in rows)
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer_mla")


@pytest.fixture(scope="module")
def mla_emulated(runs) -> tuple[list[dict], dict]:
    return _train(runs, "mla_emulated", [*MLA_Q_LATENT, *EMULATED])


def test_mla_with_query_latent_trains_under_the_emulated_kernel(mla_emulated):
    rows, norms = mla_emulated
    _assert_trains(rows)
    # Layout-independent init: every norm gamma (the latent norms included) is 1; RMSNorm has no bias.
    latent = {n: v for n, v in norms.items() if "q_layernorm" in n or "kv_layernorm" in n}
    assert len(latent) == 4 and all(n.endswith(".weight") for n in latent), sorted(norms)
    assert all(v == [1.0, 1.0] for v in norms.values()), norms


@pytest.mark.parametrize("name,flags", [
    ("mla_torch", [*MLA, "--attention-backend", "torch"]),
    ("qknorm_emulated", [*QK_NORM, *EMULATED]),
    ("qknorm_torch", [*QK_NORM, "--attention-backend", "torch"]),
])
def test_variant_trains(runs, name, flags):
    rows, norms = _train(runs, name, flags)
    _assert_trains(rows)
    if "--qk-layernorm" in flags:  # per-head LayerNorm on q and k: gamma 1, beta 0
        assert {n for n in norms if "self_attention" in n} == {
            f"decoder.layers.{i}.self_attention.{qk}_layernorm.{p}"
            for i in (0, 1) for qk in ("q", "k") for p in ("weight", "bias")}


def test_fa_fault_acts_on_mla_from_its_onset(runs, mla_emulated):
    """Same run with the emulated FA fault from iteration 3: bit-identical before the onset, the same
    forward at the onset (the fault acts in the backward only), other gradients from it on."""
    clean, _ = mla_emulated
    faulty, _ = _train(runs, "mla_fault", [*MLA_Q_LATENT, *EMULATED, "--fa-fault-strength", "64",
                                           "--fa-fault-onset", str(FAULT_ONSET)])
    for before, after in zip(clean[:FAULT_ONSET - 1], faulty[:FAULT_ONSET - 1]):
        assert (before["lm_loss"], before["grad_norm"]) == (after["lm_loss"], after["grad_norm"])
    at = FAULT_ONSET - 1
    assert clean[at]["lm_loss"] == faulty[at]["lm_loss"]
    assert clean[at]["grad_norm"] != faulty[at]["grad_norm"]
    assert clean[at + 1]["lm_loss"] != faulty[at + 1]["lm_loss"]


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
@pytest.mark.distributed
def test_qk_norm_tp2_sequence_parallel_matches_single_process(runs):
    """The per-head q/k norms' gradients are partial per TP rank (each rank holds some heads);
    megatron-core sums them over TP: the second step, which sees the first step's update, agrees."""
    from tests.megatron_core._torchrun import run_torchrun

    flags = [*TINY_MOE, *QK_NORM, "--attention-backend", "torch", "--train-iters", "2"]
    single, tp2 = runs / "qknorm_single.jsonl", runs / "qknorm_tp2.jsonl"
    script = REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_mechmon.py"
    run_python(script, [*flags, "--metrics-jsonl", single], timeout_s=150).check()
    # 64 x TP 2 pads the vocabulary to 384, as 128 x TP 1 does in the single process.
    run_torchrun(script, [*flags, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--make-vocab-size-divisible-by", "64", "--metrics-jsonl", tp2], nproc=2,
                 timeout_s=150).check()
    rows = [[json.loads(line) for line in path.read_text().splitlines()] for path in (single, tp2)]
    assert [len(r) for r in rows] == [2, 2]
    for one, two in zip(*rows):
        assert one["lm_loss"] == pytest.approx(two["lm_loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Flags -> configs, and refusals (no training)


def _validated(*flags: str, world_size: int = 1):
    from gpt_trainer import args as trainer_args  # installed with the package (setup.py)

    return trainer_args.validate_args(trainer_args.parse_args([*TINY_MOE, *flags]), world_size)


def test_flags_build_the_megatron_configs():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from gpt_trainer.model import build_transformer_config

    plain = build_transformer_config(_validated())
    assert type(plain) is TransformerConfig and plain.normalization == "LayerNorm" and not plain.qk_layernorm
    qk = build_transformer_config(_validated(*QK_NORM, "--normalization", "RMSNorm"))
    assert type(qk) is TransformerConfig and qk.qk_layernorm and qk.normalization == "RMSNorm"
    mla = build_transformer_config(_validated(*MLA_Q_LATENT, *EMULATED))
    assert isinstance(mla, MLATransformerConfig) and mla.multi_latent_attention
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim) == (
        32, 16, 16, 8, 8)
    assert (mla.rope_type, mla.normalization, mla.qk_layernorm) == ("rope", "RMSNorm", True)


@pytest.mark.parametrize("flags,world_size,message", [
    ([*MLA], 1, "needs --attention-backend torch or emulated-lowp-fa"),
    ([*MLA, *EMULATED, "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "needs --tensor-model-parallel-size 1"),
    ([*MLA, *EMULATED, "--qk-layernorm"], 1, "--qk-layernorm needs --q-lora-rank"),
    ([*MLA, *EMULATED, "--num-query-groups", "2"], 1, "has no query groups"),
    ([*MLA, *EMULATED, "--kv-channels", "16"], 1, "--kv-channels has no effect"),
    ([*MLA, *EMULATED, "--qk-pos-emb-head-dim", "5"], 1, "must be even"),
])
def test_refused_combinations_name_the_flag(flags, world_size, message):
    with pytest.raises(ValueError, match=message):
        _validated(*flags, world_size=world_size)
