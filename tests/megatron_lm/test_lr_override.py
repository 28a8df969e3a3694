"""The Megatron-LM adapter's two helpers for a supervised LR remedy: the loaded optimizer groups'
LR bounds follow the flags under ``--override-opt_param-scheduler``, and a host help text with a
lone ``%`` no longer breaks ``--help`` (which mechmon-supervise reads the host's flags from)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from mechmon_megatron.adapters.megatron_lm.flags import add_arguments, escape_stray_percent
from mechmon_megatron.adapters.megatron_lm.lr_override import retarget_param_groups


def test_every_nested_param_group_takes_the_flags_bounds():
    args = argparse.Namespace(lr=5e-4, min_lr=5e-5, decoupled_lr=2e-4, decoupled_min_lr=None)
    state = {"optimizer": [  # a chained optimizer: a plain one and a distributed one's layout
        {"optimizer": {"param_groups": [{"max_lr": 1e-3, "min_lr": 1e-4, "params": [0, 1]},
                                        {"max_lr": 4e-4, "min_lr": 1e-5, "is_decoupled_lr": True, "params": [2]}]}},
        {"param_groups": [{"max_lr": 5e-4, "min_lr": 5e-5, "params": [0]}], "state": {}},
    ]}
    assert retarget_param_groups(state, args) == 2  # the third group already had the flags' bounds
    first, decoupled = state["optimizer"][0]["optimizer"]["param_groups"]
    assert (first["max_lr"], first["min_lr"], first["params"]) == (5e-4, 5e-5, [0, 1])
    assert (decoupled["max_lr"], decoupled["min_lr"]) == (2e-4, 1e-5)  # no --decoupled-min-lr: kept
    assert retarget_param_groups({"optimizer": None}, args) == 0


def test_a_lone_percent_in_a_host_help_is_escaped_and_help_prints():
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--stash-factor", type=float, help="Headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--lr", type=float, default=1e-3, help="Peak LR (default %(default)s).")
    with pytest.raises(ValueError), contextlib.redirect_stdout(io.StringIO()):
        parser.format_help()
    assert escape_stray_percent(parser) == ["--stash-factor"]
    text = add_arguments(parser).format_help()  # the provider escapes, then adds --mechmon*
    assert "10%)" in text and "default 0.001" in text and "--mechmon-interval" in text
