"""Session wiring of the Shewhart option and the misfit counter: flag, start-up refusal naming the
flag when a calibration lacks the ``shewhart`` section, thresholds, alert record."""

import argparse
import json
import re

import pytest

from mechmon_megatron.cli.args import add_mechmon_args, config_from_args
from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.detect.null_model import JobShape, load_tail_table
from mechmon_megatron.detect.pooled_cusum import PooledAlarm
from mechmon_megatron.session.config import MechmonConfig, flag_of
from mechmon_megatron.session.detector_setup import alert_of, build_detector, load_detector_design

SHAPE = JobShape(layers={"attn_delta2": 4, "attn_dw": 4, "router_entropy": 4, "router_weights": 4}, interval=20,
                 overlap=5)


def test_flag_is_off_by_default_and_maps_onto_the_config():
    parser = add_mechmon_args(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args([])).detector_shewhart is False
    assert config_from_args(parser.parse_args(["--mechmon-detector-shewhart"])).detector_shewhart is True


def test_default_design_has_no_limits_and_the_misfit_counter_on():
    config = MechmonConfig(enabled=True, interval=20, delta=100)
    design, table = load_detector_design(config)
    detector, account = build_detector(config, SHAPE, design, table)
    assert not design.shewhart and account.shewhart_share is None
    assert all(t.layer.shewhart is None for t in detector.thresholds.values())
    assert detector.misfit is not None
    assert detector.misfit.warning_probability == account.warning_per_test_check_probability


def test_shewhart_with_the_shipped_calibration_sets_limits():
    config = MechmonConfig(enabled=True, interval=20, delta=100, detector_shewhart=True)
    design, table = load_detector_design(config)
    detector, account = build_detector(config, SHAPE, design, table)
    assert design.shewhart and account.shewhart_share == 0.5
    assert all(t.layer.shewhart is not None and t.family.shewhart is not None for t in detector.thresholds.values())


def test_calibration_without_shewhart_section_is_refused_naming_the_flag(tmp_path):
    old = load_tail_table().to_dict()
    del old["shewhart"]
    path = tmp_path / "old_tails.json"
    path.write_text(json.dumps(old))
    load_detector_design(MechmonConfig(enabled=True, interval=20, delta=100, detector_calibration=str(path)))
    with pytest.raises(ConfigError) as info:
        load_detector_design(
            MechmonConfig(enabled=True, interval=20, delta=100, detector_calibration=str(path), detector_shewhart=True)
        )
    assert info.value.field == "detector_shewhart"
    assert re.match(r"--mechmon-detector-shewhart: the calibration .* has no Shewhart tails .*mechmon-calibrate",
                    info.value.render(flag_of))


def test_alert_of_a_shewhart_alarm():
    config = MechmonConfig(enabled=True, interval=20, delta=100, detector_shewhart=True)
    design, _ = load_detector_design(config)
    alarm = PooledAlarm(step=2060, family="attn_delta2", level="layer", kind="shewhart", layers=(3,),
                        members=("head_1",), statistic=7.5, threshold=7.0, change_step=2040)
    alert = alert_of(alarm, config, design)
    assert alert.kind == "shewhart" and alert.stream == "mechmon/detect/attn_delta2/residual/layer_3"
    assert alert.first_warning_step == 2040 + 20 - 100 and "Shewhart limit" in alert.reason and alert.head == 1
    assert alert.reason.endswith("(layer test; set by --mechmon-false-alarm-rate 0.01)")
    from mechmon_megatron.scan.config import scan_flag

    scan = alert_of(alarm, config, design, spell=scan_flag)  # mechmon-scan: its own flag in the reason
    assert scan.reason == alert.reason.replace("--mechmon-false-alarm-rate", "--false-alarm-rate")
