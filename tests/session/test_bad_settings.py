"""A bad value of every setting, through every front end: one line naming the setting the way that
front end spells it.

The settings are the ``MechmonConfig`` fields (their metadata, ``session/options.py``); the front
ends are the command line (a real ``argparse`` parser with ``add_mechmon_args``, refused by
``validate_mechmon_args`` or by argparse itself), the ``"mechmon"`` section of a DeepSpeed config
(``parse_section``) and ``mechmon-scan`` for the settings it shares (its own parser and
``ScanConfig``, through ``main``). A ``ConfigError`` names the field; each front end renders it once.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from mechmon_megatron.adapters.deepspeed.config import key_of, parse_section
from mechmon_megatron.cli.args import add_mechmon_args, validate_mechmon_args
from mechmon_megatron.detect.config_error import ConfigError, ConfigNote, literal
from mechmon_megatron.scan.config import SHARED_SETTINGS, ScanConfig, scan_flag
from mechmon_megatron.session.config import OPTIONS, MechmonConfig, flag_of

FILE = "A_FILE"
"""Stands for a path that exists and is a file (not a folder, not a calibration table)."""

BAD: dict[str, tuple[Any, str]] = {
    # field: (a bad JSON / Python value, the same value on a command line); bools: argparse's own refusal
    "enabled": ("yes", "=x"),
    "interval": (0, "0"),
    "delta": (-1, "-1"),
    "monitors": (["attn", "mlp"], "attn,mlp"),
    "alpha": (0, "inf"),
    "qk_method": ("svd", "svd"),
    "full_matrix_dw": (1, "=x"),
    "full_matrix_method": ("svd", "svd"),
    "full_matrix_rank": (0, "0"),
    "wq_norm_power_iters": (-1, "-1"),
    "action": ("panic", "panic"),
    "exit_code": (17, "17"),
    "weights": ("fp8", "fp8"),
    "snapshot_device": ("gpu", "gpu"),
    "snapshot_max_device_share": (1.5, "1.5"),
    "log_dir": (FILE, FILE),  # a file is no log folder: the start-up check (validate_startup)
    "drill_at": (0, "0"),
    "strict": ("true", "=x"),
    "collective_timeout": (-1, "nan"),
    "per_head_scalars": (None, "=x"),
    "router_entropy_bins": (4, "4"),
    "router_min_effective_experts": (0.5, "half"),
    "false_alarm_rate": (2e6, "-1"),
    "detector_calibration": ("missing.json", "missing.json"),
    "alert_webhook": ("ftp://hooks.example/x", "hooks.example/x"),
    "detector_shewhart": ([], "=x"),
    "short_window": (0, "=x"),
}

WRONG_TYPE = {"int": "x", "float": "x"}
"""Command-line text argparse itself refuses for the flag's type (its own one-line error)."""


def test_every_setting_has_a_bad_value_here():
    assert set(BAD) == set(OPTIONS) and list(OPTIONS)[-1] == "short_window"


@pytest.fixture()
def a_file(tmp_path: Path) -> str:
    path = tmp_path / "file"
    path.write_text("not a folder")
    return str(path)


def _value(value: Any, a_file: str) -> Any:
    return a_file if value == FILE else value


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].split("error: ", 1)[1]


def _named(message: str, spelled: str) -> bool:
    """``message`` names the setting first, as ``spelled`` (argparse: ``argument --flag: ...``)."""
    return bool(re.match(rf"(argument )?{re.escape(spelled)}\b[ :]", message))


# ---------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("name", list(OPTIONS))
def test_command_line(name, a_file, capsys):
    option, text = OPTIONS[name], _value(BAD[name][1], a_file)
    flag = flag_of(name)
    parser = add_mechmon_args(argparse.ArgumentParser(prog="trainer"))
    # A bool flag cannot be given a bad value: argparse refuses "--mechmon-strict=x" itself, naming it.
    argv = [f"{flag}{text}"] if option.kind == "bool" else [flag, text]
    with pytest.raises(SystemExit) as info:
        validate_mechmon_args(parser, parser.parse_args(["--mechmon", *argv] if name != "enabled" else argv))
    assert info.value.code == 2
    message = _one_error_line(capsys.readouterr().err)
    assert _named(message, flag) and "ds_config" not in message and "$" not in message, message


@pytest.mark.parametrize("name", [n for n, o in OPTIONS.items() if o.kind in WRONG_TYPE])
def test_command_line_wrong_type(name, capsys):
    flag = flag_of(name)
    parser = add_mechmon_args(argparse.ArgumentParser(prog="trainer"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--mechmon", flag, WRONG_TYPE[OPTIONS[name].kind]])
    assert info.value.code == 2
    assert _one_error_line(capsys.readouterr().err).startswith(f"argument {flag}: invalid ")


# ---------------------------------------------------------------------------- DeepSpeed
@pytest.mark.parametrize("name", list(OPTIONS))
def test_deepspeed_section(name, a_file):
    section = {"enabled": True, name: _value(BAD[name][0], a_file)}
    with pytest.raises(ValueError) as info:
        parse_section(section)
    message = str(info.value)
    assert "\n" not in message and _named(message, key_of(name)), message
    assert "--mechmon" not in message and "$" not in message, message


@pytest.mark.parametrize("name", list(OPTIONS))
def test_deepspeed_section_wrong_type(name):
    with pytest.raises(ValueError, match=rf"^{re.escape(key_of(name))} must be "):
        parse_section({"enabled": True, name: {"not": "valid"}})


# ---------------------------------------------------------------------------- mechmon-scan
@pytest.mark.parametrize("name", SHARED_SETTINGS)
def test_scan_command_line(name, tmp_path, capsys):
    from mechmon_megatron.scan.cli import main

    flag = scan_flag(name)
    assert flag == "--" + name.replace("_", "-")
    assert main(["run", "--out", str(tmp_path / "out"), flag, BAD[name][1]]) == 2
    message = _one_error_line(capsys.readouterr().err)
    assert _named(message, flag) and "--mechmon" not in message and "$" not in message, message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", SHARED_SETTINGS)
def test_scan_config(name, tmp_path):
    from mechmon_megatron.scan import ScanInputError

    with pytest.raises(ScanInputError) as info:
        ScanConfig(inputs=("run",), out=str(tmp_path / "out"), **{name: BAD[name][0]})
    assert _named(str(info.value), scan_flag(name)) and "--mechmon" not in str(info.value), str(info.value)


@pytest.mark.parametrize("name", [n for n in SHARED_SETTINGS if OPTIONS[n].kind in WRONG_TYPE])
def test_scan_command_line_wrong_type(name, tmp_path, capsys):
    from mechmon_megatron.scan.cli import main

    flag = scan_flag(name)
    with pytest.raises(SystemExit) as info:
        main(["run", "--out", str(tmp_path / "out"), flag, "x"])
    assert info.value.code == 2
    assert _one_error_line(capsys.readouterr().err).startswith(f"argument {flag}: invalid ")


# ---------------------------------------------------------------------------- one error, many spellings
def test_a_config_error_renders_its_placeholders_in_each_spelling():
    with pytest.raises(ConfigError) as info:
        MechmonConfig(enabled=True, interval=20, delta=30, short_window=True)
    exc = info.value
    assert (exc.field, str(exc).split(" (")[0]) == ("short_window", "short_window needs delta a multiple of interval "
                                                                    "and larger than it")
    assert exc.render(flag_of).startswith(
        "--mechmon-short-window needs --mechmon-delta a multiple of --mechmon-interval and larger than it")
    assert exc.render(key_of).startswith("ds_config.mechmon.short_window needs ds_config.mechmon.delta a multiple "
                                         "of ds_config.mechmon.interval")
    note = ConfigNote("delta", "500 / $interval 100: held at once")
    assert note.render(scan_flag) == "--mechmon-delta 500 / --mechmon-interval 100: held at once"
    # A user's value that holds a "$" renders as itself, in every spelling.
    with pytest.raises(ConfigError) as info:
        MechmonConfig(detector_calibration="/no/$delta/tails.json")
    assert info.value.render(key_of).endswith("got '/no/$delta/tails.json'")
    assert ConfigError("log_dir", f"{literal('$x$$')} cannot be written").render(flag_of) == (
        "--mechmon-log-dir $x$$ cannot be written")
