"""Policy files: the shipped default, validation against a host's --help, user-policy errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechmon_megatron.supervise.host import parse_help
from mechmon_megatron.supervise.policy import PolicyError, load_policy, resolve_policy

TRAINER_HELP = """usage: x
  --lr LR  --min-lr MIN_LR  --moe-aux-loss-coeff C  --attention-backend {local,torch,emulated-lowp-fa}
  --fa-fp32-o  --fa-tie-shift-beta B  --mechmon-drill-at N  --save SAVE  --load LOAD  --ckpt-step N
"""
MEGATRON_HELP = """  --lr LR --min-lr L --attention-backend {flash,fused,unfused,local,auto}
  --fp8-dot-product-attention --moe-router-dtype {fp32,fp64} --moe-z-loss-coeff C --moe-aux-loss-coeff C
  --iterations-to-skip ITERATIONS_TO_SKIP [ITERATIONS_TO_SKIP ...] --ckpt-step N --mechmon-drill-at N
"""


def test_parse_help_flags_and_choices():
    host = parse_help(TRAINER_HELP)
    assert host.has("--fa-fp32-o") and not host.has("--qk-clip")
    assert host.choices["--attention-backend"] == ("local", "torch", "emulated-lowp-fa")
    assert not host.accepts("--attention-backend", "unfused") and host.accepts("--lr", "1")


def test_default_policy_picks_each_hosts_alternative():
    policy = load_policy("default")
    trainer = resolve_policy(policy, parse_help(TRAINER_HELP))
    name, remedies = trainer.remedy_list("attn_delta2")
    assert name == "attention_precision"
    assert [r.remedy.name for r in remedies] == ["fp32-attention-output", "tie-shift-or-local-attention"]
    assert remedies[0].edit.set == {"--fa-fp32-o": ()}  # not Megatron's "unfused": the trainer lacks it
    assert any("qk-clip" in n for n in trainer.notices)  # skipped with a notice, not an error
    assert [r.remedy.name for r in trainer.remedy_list("router_entropy")[1]] == [
        "lower-lr", "lower-lr-again", "stronger-balancing"]
    megatron = resolve_policy(policy, parse_help(MEGATRON_HELP))
    first = megatron.remedy_list("attn_dw")[1][0].edit
    assert first.set == {"--attention-backend": ("unfused",)} and first.remove == ("--fp8-dot-product-attention",)
    assert [r.remedy.name for r in megatron.remedy_list("router_weights")[1]] == [
        "lower-lr", "lower-lr-again", "fp32-router", "stronger-balancing"]
    assert megatron.remedy_list("nonfinite") == (None, ())  # the default stops on non-finite weights
    assert megatron.remedy_list("drill")[1][0].edit.remove == ("--mechmon-drill-at",)


def test_user_policy_naming_a_missing_flag_is_an_error(tmp_path: Path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "families": {"attn_delta2": "a"},
                                "remedies": {"a": [{"name": "clip", "alternatives": [{"set": {"--qk-clip": True}}]}]}}))
    with pytest.raises(PolicyError, match=r"p\.json: remedy a/clip names --qk-clip"):
        resolve_policy(load_policy(str(path)), parse_help(TRAINER_HELP))


@pytest.mark.parametrize("body, match", [
    ({"families": {}, "remedies": {}}, "version"),
    ({"version": 1, "families": {"attn_dw": "nope"}, "remedies": {}}, "not in remedies"),
    ({"version": 1, "families": {}, "remedies": {"a": [{"name": "x", "alternatives": [{"set": {"lr": 1}}]}]}},
     "not a --flag"),
    ({"version": 1, "families": {}, "remedies": {"a": [{"name": "x", "alternatives": [{"sett": {}}]}]}},
     "unknown keys"),
])
def test_malformed_policies(tmp_path: Path, body, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    with pytest.raises(PolicyError, match=match):
        load_policy(str(path))


def test_unreadable_policy(tmp_path: Path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(PolicyError, match="broken.json: cannot read"):
        load_policy(str(tmp_path / "broken.json"))


def test_a_user_policy_can_restore_the_intended_lr(tmp_path: Path):
    """docs/RECOVERY.md, "Missed": the remedy only a team that knows its intended LR can write."""
    from mechmon_megatron.supervise.command import flag_values
    from mechmon_megatron.supervise.remedy import apply_edit

    path = tmp_path / "known_lr.json"
    path.write_text(json.dumps({"version": 1, "families": {"router_entropy": "router", "router_weights": "router"},
                                "remedies": {"router": [{"name": "intended-lr", "alternatives": [
                                    {"set": {"--lr": "3e-4", "--min-lr": "3e-5"}}]}]}}))
    policy = resolve_policy(load_policy(str(path)), parse_help(TRAINER_HELP))
    name, remedies = policy.remedy_list("router_entropy")
    assert name == "router" and [r.remedy.name for r in remedies] == ["intended-lr"]
    applied = apply_edit(["--lr", "1.2e-3", "--min-lr", "1.2e-4", "--save", "ck"], remedies[0].edit)
    assert flag_values(applied.args, "--lr") == ["3e-4"] and flag_values(applied.args, "--min-lr") == ["3e-5"]
    assert flag_values(applied.args, "--save") == ["ck"] and len(applied.args) == 6
    assert applied.removed == ["--lr 1.2e-3", "--min-lr 1.2e-4"]


def test_alert_families_and_the_shipped_policy_read_the_family_table():
    """The alert families are the detector's table plus the two of the session; the shipped policy
    answers each detector family with its table ``remedy`` (the JSON file lists only the others),
    and a family without one is left out, so the supervisor says it has no remedy for it."""
    import json

    from mechmon_megatron.detect.families import FAMILIES, FAMILY_NAMES
    from mechmon_megatron.session.alert import ALERT_FAMILIES
    from mechmon_megatron.supervise.policy import DEFAULT_POLICY

    assert ALERT_FAMILIES == (*FAMILY_NAMES, "nonfinite", "drill")
    shipped = load_policy("default").families
    assert set(shipped) <= set(ALERT_FAMILIES)
    assert {f: shipped.get(f) for f in FAMILY_NAMES} == {s.name: s.remedy for s in FAMILIES}
    assert shipped == {"attn_delta2": "attention_precision", "attn_dw": "attention_precision",
                       "router_entropy": "router", "router_weights": "router", "nonfinite": None, "drill": "rehearsal"}
    with open(DEFAULT_POLICY, encoding="utf-8") as f:
        assert not set(json.load(f)["families"]) & set(FAMILY_NAMES)  # declared once, in the table


def test_mla_command_skips_megatrons_local_attention_remedy():
    """megatron-core's local DotProductAttention cannot run multi-head latent attention: for a
    command with --multi-latent-attention the default ladder passes over it, with the reason."""
    policy = load_policy("default")
    plain = resolve_policy(policy, parse_help(MEGATRON_HELP), command_flags={"--lr"})
    mla = resolve_policy(policy, parse_help(MEGATRON_HELP), command_flags={"--lr", "--multi-latent-attention"})
    names = [r.remedy.name for r in plain.remedy_list("attn_delta2")[1]]
    assert "tie-shift-or-local-attention" in names
    assert [r.remedy.name for r in mla.remedy_list("attn_delta2")[1]] == [n for n in names
                                                                         if n != "tie-shift-or-local-attention"]
    assert any("tie-shift-or-local-attention skipped for this command (--multi-latent-attention: megatron-core's "
               "local DotProductAttention cannot run multi-head latent attention" in n for n in mla.notices)
    assert mla.remedy_list("attn_delta2")[1][0].edit.set == {"--attention-backend": ("unfused",)}


def test_unless_must_name_reasons(tmp_path: Path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "families": {"attn_delta2": "a"}, "remedies": {"a": [
        {"name": "x", "alternatives": [{"set": {"--lr": 1}, "unless": ["--multi-latent-attention"]}]}]}}))
    with pytest.raises(PolicyError, match="unless must map flags to the reason"):
        load_policy(str(path))
