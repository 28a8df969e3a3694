"""``mechmon-run``: an unmodified ``pretrain_gpt.py`` with the monitors attached from outside.

The scripts are the release-structured fixtures of ``release_fixtures`` (core_v0.16 style: the
provider goes to ``pretrain``, parsed in ``initialize_megatron``; core_v0.18+ style:
``parse_and_validate_args`` in the script), run against a fake ``megatron.training`` tree built in
``tmp_path`` that keeps Megatron's call order and name bindings (the megatron-core wheel has no
``megatron.training``). The real checkout is ``test_e2e.py`` (opt-in).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import types

import pytest
from release_fixtures import make_checkout

from mechmon_megatron.adapters.megatron_lm import patch_tool as mp
from mechmon_megatron.adapters.megatron_lm import run

pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = [sys.executable, "-m", "mechmon_megatron.adapters.megatron_lm.run"]
CPU = [sys.executable, "-m", "mechmon_megatron.testing.megatron_lm_cpu"]


def launch(command, checkout, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([*command, "pretrain_gpt.py", *args], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=timeout)


# core_v0.16 is slow (fast leg budget): core_v0.19 runs in the fast leg.
@pytest.mark.parametrize("release", [pytest.param("core_v0.16", marks=pytest.mark.slow), "core_v0.19"])
def test_unmodified_script_runs_with_the_hooks_and_the_flags(tmp_path, release):
    checkout = make_checkout(tmp_path, release, runnable=True)
    original = open(os.path.join(checkout, "pretrain_gpt.py"), "rb").read()
    proc = launch(RUN, checkout, "--train-iters", "3", "--mechmon", "--mechmon-interval", "7",
                  "--mechmon-action", "checkpoint-and-abort", "--save", str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "HOOKED True" in out
    assert "MECHMON True 7 checkpoint-and-abort" in out
    assert "MEGATRON 3" in out  # Megatron's own flags are untouched
    assert out.index("PARSED") < out.index("INIT_DISTRIBUTED") < out.index("BUILD_MODEL")
    assert open(os.path.join(checkout, "pretrain_gpt.py"), "rb").read() == original  # never modified


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_the_scripts_own_provider_still_works(tmp_path):
    """core_v0.16 structure: ModelOpt's provider (present in the fake tree) is chained with ours."""
    checkout = make_checkout(tmp_path, "core_v0.16", runnable=True)
    proc = launch(RUN, checkout, "--train-iters", "2", "--modelopt-level", "5", "--mechmon")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MEGATRON 2 5" in proc.stdout and "MECHMON True" in proc.stdout


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_without_mechmon_flag_the_run_is_plain(tmp_path):
    checkout = make_checkout(tmp_path, "core_v0.18", runnable=True)
    proc = launch(RUN, checkout, "--train-iters", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MECHMON False" in proc.stdout and "HOOKED True" in proc.stdout


# core_v0.16 is slow (fast leg budget): core_v0.19 runs in the fast leg.
@pytest.mark.parametrize("release", [pytest.param("core_v0.16", marks=pytest.mark.slow), "core_v0.19"])
def test_bad_flag_is_refused_at_parse_time_with_status_2(tmp_path, release):
    checkout = make_checkout(tmp_path, release, runnable=True)
    proc = launch(RUN, checkout, "--train-iters", "3", "--mechmon", "--mechmon-action", "explode")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "mechmon: error: --mechmon-action must be one of" in proc.stderr
    assert "explode" in proc.stderr and "usage: pretrain_gpt.py [Megatron-LM flags] --mechmon" in proc.stderr
    assert "INIT_DISTRIBUTED" not in proc.stdout and "BUILD_MODEL" not in proc.stdout  # no process group, no model


def test_mechmon_flags_without_the_switch_are_refused_at_parse_time(tmp_path):
    """Megatron parses sys.argv itself: the flags it was given are recorded by our provider's
    parser, and the wrapped parse refuses them without --mechmon before anything starts."""
    checkout = make_checkout(tmp_path, "core_v0.19", runnable=True)
    proc = launch(RUN, checkout, "--train-iters", "3", "--mechmon-interval", "7", "--mechmon-strict")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["mechmon: error: --mechmon-interval, --mechmon-strict given without --mechmon: add --mechmon to "
                      "monitor, or drop them"], proc.stderr
    assert "INIT_DISTRIBUTED" not in proc.stdout and "BUILD_MODEL" not in proc.stdout  # no process group, no model


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_unknown_mechmon_flag_is_refused_by_the_parser(tmp_path):
    checkout = make_checkout(tmp_path, "core_v0.19", runnable=True)
    proc = launch(RUN, checkout, "--mechmon-intervall", "3")
    assert proc.returncode == 2 and "--mechmon-intervall" in proc.stderr, proc.stderr
    assert "INIT_DISTRIBUTED" not in proc.stdout


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_patched_script_gets_the_flags_once(tmp_path):
    checkout = make_checkout(tmp_path, "core_v0.19", runnable=True)
    from release_fixtures import RELEASES, write_package_info

    write_package_info(checkout, RELEASES["core_v0.19"])
    mp.apply(checkout)
    shutil.rmtree(os.path.join(checkout, "megatron", "core"))  # the installed megatron-core must win
    proc = launch(RUN, checkout, "--mechmon", "--mechmon-interval", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MECHMON True 4" in proc.stdout and "HOOKED True" in proc.stdout


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
@pytest.mark.parametrize("release", ["core_v0.16", "core_v0.19"])
def test_patched_script_alone_also_validates_at_parse_time(tmp_path, release):
    """The patch path (``python pretrain_gpt.py``): the script's install() wraps the parsing too."""
    from release_fixtures import RELEASES, write_package_info

    checkout = make_checkout(tmp_path, release, runnable=True)
    write_package_info(checkout, RELEASES[release])
    mp.apply(checkout)
    shutil.rmtree(os.path.join(checkout, "megatron", "core"))
    plain = [sys.executable]
    ok = launch(plain, checkout, "--mechmon", "--mechmon-interval", "4")
    assert ok.returncode == 0 and "MECHMON True 4" in ok.stdout and "HOOKED True" in ok.stdout, ok.stderr
    bad = launch(plain, checkout, "--mechmon", "--mechmon-action", "explode")
    assert bad.returncode == 2 and "mechmon: error: --mechmon-action must be one of" in bad.stderr, bad.stderr
    assert "INIT_DISTRIBUTED" not in bad.stdout


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_cpu_launcher_runs_an_unmodified_script_through_mechmon_run(tmp_path):
    """The CPU layer is applied at the first parsing call: after the script's imports, before
    initialize_megatron (which then gets allow_no_cuda=True)."""
    checkout = make_checkout(tmp_path, "core_v0.16", runnable=True)
    proc = launch(CPU, checkout, "--train-iters", "3", "--mechmon", "--mechmon-interval", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALLOW_NO_CUDA True" in proc.stdout and "HOOKED True" in proc.stdout
    assert "SCRIPT_TORCH _TrainingCpuTorch" in proc.stdout  # the script's own torch global is proxied
    bad = launch(CPU, checkout, "--mechmon", "--mechmon-interval", "0")
    assert bad.returncode == 2 and "--mechmon-interval must be >= 1" in bad.stderr, bad.stderr


def test_under_torchrun_every_rank_runs_the_script(tmp_path):
    checkout = make_checkout(tmp_path, "core_v0.19", runnable=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "mechmon_megatron.adapters.megatron_lm.run"]
    proc = launch(torchrun, checkout, "--mechmon", "--mechmon-interval", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("HOOKED True") == 2 and proc.stdout.count("MECHMON True 3") == 2
    wrapper = tmp_path / "mechmon-run"  # what pip writes for the console script: `torchrun $(which mechmon-run)`
    wrapper.write_text("import sys\nfrom mechmon_megatron.adapters.megatron_lm.run import main\nsys.exit(main())\n")
    torchrun[-2:] = [str(wrapper)]
    bad = launch(torchrun, checkout, "--mechmon", "--mechmon-action", "explode")
    assert bad.returncode != 0 and "--mechmon-action must be one of" in bad.stderr
    assert "INIT_DISTRIBUTED" not in bad.stdout


def test_usage_errors(tmp_path, capsys):
    assert run.main([]) == run.EXIT_USAGE
    assert run.main(["--help"]) == 0 and "usage: mechmon-run SCRIPT" in capsys.readouterr().out
    assert run.main(["--mechmon"]) == run.EXIT_USAGE
    assert "must be the training script" in capsys.readouterr().err
    assert run.main([str(tmp_path / "missing.py")]) == run.EXIT_USAGE


def test_console_script_is_declared():
    setup = open(os.path.join(REPO, "setup.py")).read()
    assert '"mechmon-run=mechmon_megatron.adapters.megatron_lm.run:main"' in setup


# ---------------------------------------------------------------------------- in process
def _fake_arguments():
    arguments = types.ModuleType("fake_arguments")
    calls = []

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser()
        parser.add_argument("--train-iters", type=int)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        calls.append(ignore_unknown_args)
        return parser.parse_args(arguments.argv)

    arguments.parse_args = parse_args
    arguments.argv = []
    return arguments, calls


def test_wrapped_parser_chains_validates_and_rebinds_by_name(monkeypatch):
    arguments, calls = _fake_arguments()
    original = arguments.parse_args
    by_name = types.ModuleType("megatron.fake_initialize")  # a module that did `from ... import parse_args`
    by_name.parse_args = original
    monkeypatch.setitem(sys.modules, "megatron.fake_initialize", by_name)
    entered = []
    assert run.wrap_argument_parsing(arguments, lambda: entered.append(1)) == ["parse_args"]
    assert by_name.parse_args is arguments.parse_args is not original
    assert run.wrap_argument_parsing(arguments) == []  # idempotent

    def user_provider(parser):
        parser.add_argument("--user-flag", type=int, default=0)
        return parser

    arguments.argv = ["--train-iters", "2", "--user-flag", "9", "--mechmon", "--mechmon-interval", "6"]
    args = by_name.parse_args(user_provider)
    assert (args.train_iters, args.user_flag, args.mechmon, args.mechmon_interval) == (2, 9, True, 6)
    assert entered == [1] and calls == [False]

    arguments.argv = ["--mechmon-delta", "0"]
    with pytest.raises(SystemExit) as info:
        arguments.parse_args(extra_args_provider=None, ignore_unknown_args=True)
    assert info.value.code == 2


def test_no_parser_taking_a_provider_is_a_launch_error():
    arguments = types.ModuleType("old_arguments")
    arguments.parse_args = lambda: None
    with pytest.raises(run.LaunchError, match="mechmon-patch apply"):
        run.wrap_argument_parsing(arguments)
