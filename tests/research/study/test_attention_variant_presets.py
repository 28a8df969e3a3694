"""The study presets on attention variants of the full model (``full-mla``, ``full-qknorm``): the full
study with only model flags added, selectable from ``tools/fault_study.py``, and every run they plan
accepted by the example trainer as the megatron-core model it names."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from mechmon_megatron.research.study import scenarios as S
from tests.megatron_core._torchrun import REPO_ROOT

VARIANTS = {
    "full-mla": ("--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim", "32",
                 "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm"),
    "full-qknorm": ("--qk-layernorm",),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_is_the_full_study_with_model_flags_added(name):
    full, variant = S.get_preset("full"), S.get_preset(name)
    assert variant.name == name
    assert variant.model_flags == full.model_flags + VARIANTS[name]
    same = {f.name for f in dataclasses.fields(S.Preset)} - {"name", "model_flags"}
    assert {f: getattr(variant, f) for f in same} == {f: getattr(full, f) for f in same}


def test_fault_study_cli_offers_the_variants():
    spec = importlib.util.spec_from_file_location("fault_study_cli", REPO_ROOT / "tools" / "fault_study.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    for name in VARIANTS:
        assert cli.build_parser().parse_args(["--preset", name, "--out", "x"]).preset == name


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_trainer_accepts_every_planned_run(name):
    pytest.importorskip("megatron.core")
    from gpt_trainer.args import build_parser, validate_args
    from gpt_trainer.model import build_transformer_config
    from mechmon_megatron.cli.args import add_mechmon_args

    for run in S.plan_runs(S.SCENARIO_NAMES, (1,), S.get_preset(name), train_iters=10):
        args = validate_args(build_parser([add_mechmon_args]).parse_args(list(run.flags)), world_size=1)
        config = build_transformer_config(args)
        assert config.qk_layernorm and config.hidden_size == 128 and config.num_moe_experts == 8
        if name == "full-mla":
            assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
                    config.v_head_dim, config.normalization) == (64, 32, 32, 16, 32, "RMSNorm")
        else:
            assert not config.multi_latent_attention and config.normalization == "LayerNorm"
