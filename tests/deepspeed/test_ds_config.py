"""The "mechmon" section of a DeepSpeed config: validation messages name the key."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mechmon_megatron.adapters.deepspeed.attention_layouts import MappingEntry
from mechmon_megatron.adapters.deepspeed.config import EXTRA_KEYS, config_from_ds_config, parse_section
from mechmon_megatron.session.config import MechmonConfig


def test_absent_section_is_disabled():
    assert config_from_ds_config({"train_batch_size": 4}).enabled is False


def test_full_section_round_trip(tmp_path):
    section = {
        "enabled": True,
        "interval": 10,
        "delta": 5,
        "monitors": "router",
        "alpha": 1,
        "action": "checkpoint-and-abort",
        "exit_code": 43,
        "drill_at": 7,
        "log_dir": "runs/x",
        "per_head_scalars": True,
        "false_alarm_rate": 0.5,
        "checkpoint_dir": "ckpt",
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "mechmon": section}))
    cfg = config_from_ds_config(path)
    assert (cfg.enabled, cfg.interval, cfg.delta, cfg.monitors, cfg.alpha) == (True, 10, 5, ("router",), 1.0)
    assert (cfg.action, cfg.exit_code, cfg.drill_at, cfg.false_alarm_rate) == ("checkpoint-and-abort", 43, 7, 0.5)
    assert cfg.extra == {"checkpoint_dir": "ckpt"}
    on = {"enabled": True}
    assert parse_section({**on, "router_min_effective_experts": 1.5}).router_min_effective_experts == 1.5
    assert parse_section({**on, "router_min_effective_experts": "off"}).router_min_effective_experts == 0.0
    assert parse_section({}).router_min_effective_experts == "topk"


def test_every_field_is_a_key():
    fields = {f.name for f in dataclasses.fields(MechmonConfig)} - {"extra"}
    for name in fields:  # each key has a type rule: a wrong type names it
        with pytest.raises(ValueError, match=rf"ds_config\.mechmon\.{name} "):
            parse_section({name: {"not": "valid"}})
    assert not set(EXTRA_KEYS) & fields


@pytest.mark.parametrize(
    "section,message",
    [
        ({"interval": 0}, r"^ds_config\.mechmon\.interval must be >= 1, got 0$"),
        ({"delta": -1}, r"^ds_config\.mechmon\.delta must be >= 1"),
        ({"exit_code": 17}, r"^ds_config\.mechmon\.exit_code must be in 2\.\.255"),
        ({"action": "panic"}, r"^ds_config\.mechmon\.action must be one of"),
        ({"monitors": ["attn", "mlp"]}, r"^ds_config\.mechmon\.monitors unknown families \['mlp'\]"),
        ({"qk_method": "svd"}, r"^ds_config\.mechmon\.qk_method must be gram or compressed"),
        ({"interval": "10"}, r"^ds_config\.mechmon\.interval must be an integer, got '10'"),
        ({"enabled": 1}, r"^ds_config\.mechmon\.enabled must be true or false"),
        ({"intervall": 5}, r"^ds_config\.mechmon: unknown key\(s\) \['intervall'\]"),
        ({"checkpoint_dir": 3}, r"^ds_config\.mechmon\.checkpoint_dir must be a string"),
        ({"router_min_effective_experts": 0.5}, r"^ds_config\.mechmon\.router_min_effective_experts must be topk, off"),
        ({"router_min_effective_experts": "most"}, r"^ds_config\.mechmon\.router_min_effective_experts must be topk"),
        ({"attention_mapping": {}}, r"^ds_config\.mechmon\.attention_mapping must be a list"),
        ({"attention_mapping": [{"match": "a", "layout": "weird"}]}, r"attention_mapping\[0\]\.layout must be one of"),
        ({"attention_mapping": [{"match": "a", "layout": "separate", "q": "q.weight", "num_heads": 2}]},
         r"attention_mapping\[0\]\.k is required"),
        ({"attention_mapping": [{"match": "a", "layout": "stacked_qkv", "qkv": "w", "num_heads": 0}]},
         r"attention_mapping\[0\]\.num_heads must be a positive integer"),
    ],
)
def test_errors_name_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        parse_section(section)


def test_mapping_is_parsed():
    cfg = parse_section({"enabled": True, "attention_mapping": [
        {"match": "blocks.*.attn", "layout": "separate", "q": "wq.weight", "k": "wk.weight", "num_heads": 4},
        {"match": "enc.*", "skip": True}]})
    assert cfg.extra["attention_mapping"][0] == MappingEntry(match="blocks.*.attn", layout="separate", q="wq.weight",
                                                             k="wk.weight", num_heads=4)
    assert cfg.extra["attention_mapping"][1].skip


@pytest.mark.parametrize("section", [{"interval": 10}, {"action": "checkpoint-and-abort", "checkpoint_dir": "ck"},
                                     {"attention_mapping": []}])
def test_section_without_enabled_is_refused_naming_the_key(section):
    """Keys without "enabled" say the user wants monitoring: refused, not a silent disabled section."""
    with pytest.raises(ValueError, match=r"^ds_config\.mechmon\.enabled is not set, but the section sets "
                                         r"\[.*\]: add \"enabled\": true to monitor, or \"enabled\": false"):
        config_from_ds_config({"train_batch_size": 4, "mechmon": section})


def test_explicit_disabled_section_and_empty_section_are_accepted():
    assert config_from_ds_config({"mechmon": {"enabled": False, "interval": 10}}).enabled is False
    assert config_from_ds_config({"mechmon": {}}).enabled is False  # nothing asked for: as if absent
