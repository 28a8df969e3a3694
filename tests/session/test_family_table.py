"""What the session reads from the family table: switches that are config fields with a flag, stream
names that parse back to their family, and the start-up lines (unchanged from when they were spelled
here), in each front end's spelling."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mechmon_megatron.cli.args import add_mechmon_args
from mechmon_megatron.detect.families import FAMILIES, FAMILY_NAMES, FamilySpec
from mechmon_megatron.detect.null_model import JobShape
from mechmon_megatron.session import names
from mechmon_megatron.session.config import MONITOR_FAMILIES, MechmonConfig, flag_of
from mechmon_megatron.session.detector_inputs import observation, observations_from_scalars
from mechmon_megatron.session.detector_setup import (
    detector_families,
    families_without_signal,
    fed_families,
    local_layers,
)
from mechmon_megatron.session.startup import job_layers


@pytest.mark.parametrize("spec", FAMILIES, ids=FAMILY_NAMES)
def test_switches_are_config_fields_and_flags_are_flags(spec: FamilySpec):
    assert spec.monitor in MONITOR_FAMILIES
    if spec.switch is None:
        return
    field = {f.name: f for f in dataclasses.fields(MechmonConfig)}[spec.switch]
    assert field.type in (bool, "bool")
    assert field.default is (not spec.optional)  # an optional family is off by default
    parser = add_mechmon_args(argparse.ArgumentParser())
    assert flag_of(spec.switch) in parser._option_string_actions  # noqa: SLF001 -- the parser's own table


@pytest.mark.parametrize("spec", FAMILIES, ids=FAMILY_NAMES)
def test_each_scalar_parses_back_to_its_family(spec: FamilySpec):
    make = names.attn if spec.monitor == "attn" else names.router
    for scalar in spec.scalars:
        name = make(scalar, 7, 3) if spec.per_head else make(scalar, 7)
        obs = observation(name, 0.5)
        assert obs is not None and (obs.family, obs.layer) == (spec.name, 7)
        assert obs.member == ("head_3" if spec.per_head else scalar)
    assert observation(f"{names.PREFIX}/{spec.monitor}/{spec.scalars[0]}_min/layer_7", 0.5) is None


def test_the_routing_entropy_floor_is_its_limit():
    scalars = {names.router("token_entropy", 2): 0.4, names.router("token_entropy_floor", 2): 0.7,
               names.router("weight_similarity", 2): 0.1}
    by_family = {o.family: o for o in observations_from_scalars(scalars)}
    assert by_family["router_entropy"].limit == 0.7 and by_family["router_weights"].limit is None


class _Site:
    def __init__(self, layer_number: int) -> None:
        self.layer_number = layer_number


def test_families_a_configuration_feeds():
    plain = MechmonConfig(enabled=True)
    assert detector_families(plain) == ("attn_delta2", "attn_dw", "router_entropy", "router_weights")
    short = MechmonConfig(enabled=True, interval=20, delta=100, short_window=True)
    assert detector_families(short)[-1] == "attn_delta2_short"
    assert "attn_delta2_short" not in detector_families(dataclasses.replace(short, monitors=("router",)))
    layers = local_layers(dataclasses.replace(short, full_matrix_dw=False), [_Site(2), _Site(1)], [_Site(2)])
    assert layers == {"attn_delta2": [1, 2], "attn_delta2_short": [1, 2], "router_entropy": [2],
                      "router_weights": [2]}
    assert fed_families(plain, {}) == ("attn_delta2", "attn_dw", "router_entropy", "router_weights")
    assert fed_families(dataclasses.replace(plain, monitors=("router",)), {}) == ("router_entropy", "router_weights")
    assert job_layers(plain, 12) == {"attn_delta2": 12, "attn_dw": 12}
    assert job_layers(dataclasses.replace(short, full_matrix_dw=False), 12) == {"attn_delta2": 12}
    assert job_layers(plain, None) == {"attn_delta2": 1}


def test_the_start_up_reasons_of_families_without_signal():
    config = MechmonConfig(enabled=True, interval=20, delta=100, short_window=True, full_matrix_dw=False)
    silent = families_without_signal(config, JobShape(layers={"attn_delta2": 4}, interval=20, overlap=5))
    router = "no MoE router is monitored (a dense model, or --mechmon-monitors without router)"
    assert silent == {"attn_dw": "--mechmon-no-full-matrix-dw", "router_entropy": router, "router_weights": router,
                      "attn_delta2_short": "no attention layer is monitored"}
    dense = families_without_signal(MechmonConfig(enabled=True), JobShape(layers={}, interval=20, overlap=5))
    assert dense["attn_delta2"] == "no attention layer is monitored (--mechmon-monitors without attn, or none found)"
    assert dense["attn_dw"] == "no attention layer is monitored"
    from mechmon_megatron.adapters.deepspeed.config import key_of

    keys = families_without_signal(config, JobShape(layers={"attn_delta2": 4}, interval=20, overlap=5), spell=key_of)
    assert keys["attn_dw"] == "ds_config.mechmon.full_matrix_dw"
    assert keys["router_entropy"] == ("no MoE router is monitored (a dense model, or ds_config.mechmon.monitors "
                                      "without router)")
