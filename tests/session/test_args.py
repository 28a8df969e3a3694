"""``--mechmon-*`` flags: defaults, chaining with another provider, and start-up errors."""

import argparse

import pytest

from mechmon_megatron.cli.args import add_mechmon_args, chain_providers, config_from_args, validate_mechmon_args


def parse(argv):
    parser = add_mechmon_args(argparse.ArgumentParser())
    return parser, parser.parse_args(argv)


def test_defaults_are_disabled():
    _, args = parse([])
    cfg = config_from_args(args)
    assert not cfg.enabled and cfg.interval == 100 and cfg.monitors == ("attn", "router")


def test_flags_map_onto_config():
    _, args = parse(
        "--mechmon --mechmon-interval 10 --mechmon-delta 20 --mechmon-monitors router "
        "--mechmon-action checkpoint-and-abort --mechmon-exit-code 77 --mechmon-drill-at 20 "
        "--mechmon-alpha 1 --mechmon-snapshot-device cpu".split()
    )
    cfg = config_from_args(args)
    assert (cfg.enabled, cfg.interval, cfg.delta, cfg.monitors) == (True, 10, 20, ("router",))
    assert (cfg.action, cfg.exit_code, cfg.drill_at, cfg.alpha, cfg.snapshot_device) == (
        "checkpoint-and-abort",
        77,
        20,
        1.0,
        "cpu",
    )


@pytest.mark.parametrize("text, value", [("topk", "topk"), ("off", 0.0), ("0", 0.0), ("1.5", 1.5), ("3", 3.0)])
def test_router_entropy_floor_flag(text, value):
    _, args = parse(["--mechmon", "--mechmon-router-min-effective-experts", text])
    assert config_from_args(args).router_min_effective_experts == value
    _, default = parse(["--mechmon"])
    assert config_from_args(default).router_min_effective_experts == "topk"


def test_every_config_field_has_a_flag():
    import dataclasses

    from mechmon_megatron.session.config import MechmonConfig

    parser, _ = parse([])
    flags = {opt for action in parser._actions for opt in action.option_strings}
    renamed = {"enabled": "--mechmon", "full_matrix_dw": "--mechmon-no-full-matrix-dw"}
    for f in dataclasses.fields(MechmonConfig):
        if f.name != "extra":
            assert renamed.get(f.name, "--mechmon-" + f.name.replace("_", "-")) in flags, f.name


def test_chaining_keeps_other_providers_flags():
    def other(parser):
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    parser = chain_providers(other, None, add_mechmon_args)(argparse.ArgumentParser())
    args = parser.parse_args(["--my-flag", "5", "--mechmon"])
    assert args.my_flag == 5 and args.mechmon


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--mechmon-interval", "0"], "--mechmon-interval"),
        (["--mechmon-exit-code", "16"], "--mechmon-exit-code"),
        (["--mechmon-action", "abort"], "--mechmon-action"),
        (["--mechmon-monitors", "attn,moe"], "--mechmon-monitors"),
        (["--mechmon-router-min-effective-experts", "0.5"], "--mechmon-router-min-effective-experts"),
        (["--mechmon-router-min-effective-experts", "half"], "--mechmon-router-min-effective-experts"),
        (["--mechmon-false-alarm-rate", "-1"], "--mechmon-false-alarm-rate"),
        (["--mechmon-detector-calibration", "missing.json"], "--mechmon-detector-calibration"),
        (["--mechmon-detector-num-mads", "3"], "--mechmon-false-alarm-rate"),  # removed flag names its successor
        (["--mechmon-detector-patience", "2"], "--mechmon-detector-patience"),
    ],
)
def test_bad_flag_fails_at_startup_naming_it(argv, flag, capsys):
    parser, args = parse(["--mechmon", *argv])
    with pytest.raises(SystemExit) as exc:
        validate_mechmon_args(parser, args)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def _trainer_parser():
    """The real example trainer's parser with the mechmon flags (what ``python -m gpt_trainer`` parses)."""
    pytest.importorskip("megatron.core")
    from gpt_trainer.args import build_parser

    return build_parser([add_mechmon_args])


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--mechmon-interval", "5", "--mechmon-action", "log"], "--mechmon-interval, --mechmon-action"),
        (["--mechmon-exit-code", "42"], "--mechmon-exit-code"),  # the default value, given: still a mechmon flag
        (["--mechmon-strict"], "--mechmon-strict"),
        (["--mechmon-log-dir=runs/x", "--mechmon-log-dir", "runs/y"], "--mechmon-log-dir"),  # named once
        (["--mechmon-alert-webhook", "https://hooks.example/x"], "--mechmon-alert-webhook"),
    ],
)
def test_mechmon_flags_without_the_switch_are_refused(argv, named, capsys):
    """A user who wrote --mechmon-* flags wants monitoring: without --mechmon the job would train
    unwatched with no word, so the parse fails, naming the flags and the switch."""
    parser = _trainer_parser()
    args = parser.parse_args(["--train-iters", "10", *argv])
    with pytest.raises(SystemExit) as exc:
        validate_mechmon_args(parser, args)
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"{parser.prog}: error: {named} given without --mechmon: add --mechmon to monitor, or drop "
                      f"{'them' if ',' in named else 'it'}"]


def test_given_flags_are_what_the_command_line_named_not_values_off_their_defaults():
    from mechmon_megatron.cli.args import given_mechmon_flags

    parser = _trainer_parser()
    assert given_mechmon_flags(parser.parse_args([])) == ()
    assert given_mechmon_flags(parser.parse_args(["--mechmon-interval", "100"])) == ("--mechmon-interval",)
    args = parser.parse_args(["--mechmon", "--mechmon-delta=7", "--mechmon-no-full-matrix-dw"])
    assert given_mechmon_flags(args) == ("--mechmon", "--mechmon-delta", "--mechmon-no-full-matrix-dw")
    validate_mechmon_args(parser, args)  # with the switch: accepted
    assert not config_from_args(parser.parse_args([])).enabled
    validate_mechmon_args(parser, parser.parse_args(["--train-iters", "10"]))  # no mechmon flag at all: plain run
