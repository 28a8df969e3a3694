"""The launch command: where the host's flags start, how to ask for --help, flag edits (pure)."""

from __future__ import annotations

import sys

import pytest

from mechmon_megatron.supervise.command import (
    CommandError,
    flag_values,
    parse_command,
    remove_flag,
    set_flag,
)
from mechmon_megatron.supervise.policy import Edit
from mechmon_megatron.supervise.remedy import apply_edit, diff_flags, select_checkpoint_flags


def test_python_module_and_script():
    cmd = parse_command(["python", "-u", "-m", "gpt_trainer", "--save", "ck", "--lr", "1e-3"])
    assert cmd.launcher == "python" and cmd.host_args == ["--save", "ck", "--lr", "1e-3"]
    assert cmd.help_argv == ("python", "-u", "-m", "gpt_trainer", "--help")
    cmd = parse_command(["python3", "pretrain_gpt.py", "--save", "ck"])
    assert cmd.help_argv == ("python3", "pretrain_gpt.py", "--help") and cmd.host_args == ["--save", "ck"]


def test_torchrun_options_are_not_host_flags():
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
            "--master-port=2900", "--max-restarts", "0", "pretrain_gpt.py", "--max-restarts", "7", "--save", "ck"]
    cmd = parse_command(argv)
    assert cmd.launcher == "torchrun" and cmd.host_args == ["--max-restarts", "7", "--save", "ck"]
    assert cmd.help_argv == (sys.executable, "pretrain_gpt.py", "--help")
    cmd = parse_command(["torchrun", "--nnodes", "1", "-m", "gpt_trainer", "--save", "s"])
    assert cmd.help_argv[1:] == ("-m", "gpt_trainer", "--help") and cmd.host_args == ["--save", "s"]


def test_ft_launcher_options_are_not_host_flags():
    """nvidia-resiliency-ext's ft_launcher: torchrun's options plus --ft-* ones with values."""
    cmd = parse_command(["ft_launcher", "--nproc-per-node", "8", "--max-restarts", "0", "--ft-rank-heartbeat-timeout",
                         "60", "pretrain_gpt.py", "--save", "ck"])
    assert cmd.launcher == "torchrun" and cmd.host_args == ["--save", "ck"]
    assert cmd.help_argv[1:] == ("pretrain_gpt.py", "--help")
    cmd = parse_command([sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--standalone",
                         "-m", "gpt_trainer", "--save", "s"])
    assert cmd.help_argv == (sys.executable, "-m", "gpt_trainer", "--help") and cmd.host_args == ["--save", "s"]


def test_mechmon_run_wrapper_passes_help_to_the_script():
    cmd = parse_command(["torchrun", "--nproc-per-node", "8", "-m", "mechmon_megatron.adapters.megatron_lm.run",
                         "pretrain_gpt.py", "--save", "s", "--mechmon"])
    assert cmd.help_argv[1:] == ("-m", "mechmon_megatron.adapters.megatron_lm.run", "pretrain_gpt.py", "--help")
    assert cmd.host_args == ["--save", "s", "--mechmon"]
    cmd = parse_command(["/venv/bin/mechmon-run", "pretrain_gpt.py", "--save", "s"])
    assert cmd.help_argv == ("/venv/bin/mechmon-run", "pretrain_gpt.py", "--help") and cmd.host_args == ["--save", "s"]


def test_srun_deepspeed_and_direct():
    cmd = parse_command(["srun", "-N", "2", "--ntasks-per-node=8", "deepspeed", "--num_gpus", "8", "train.py",
                         "--save", "ck"])
    assert cmd.launcher == "deepspeed" and cmd.host_args == ["--save", "ck"]
    assert cmd.help_argv[1:] == ("train.py", "--help")
    cmd = parse_command(["./train.sh", "--save", "ck"])
    assert cmd.launcher == "direct" and cmd.help_argv == ("./train.sh", "--help")
    with pytest.raises(CommandError, match="no training script"):
        parse_command(["torchrun", "--nproc-per-node", "2"])


def test_flag_values_remove_and_set():
    args = ["--lr", "1e-3", "--iterations-to-skip", "5", "6", "--bf16", "--save=ck", "--min-lr", "-1"]
    assert flag_values(args, "--iterations-to-skip") == ["5", "6"]
    assert flag_values(args, "--bf16") == [] and flag_values(args, "--save") == ["ck"]
    assert flag_values(args, "--min-lr") == ["-1"] and flag_values(args, "--load") is None
    assert remove_flag(args, "--iterations-to-skip") == ["--lr", "1e-3", "--bf16", "--save=ck", "--min-lr", "-1"]
    assert remove_flag(args, "--save") == ["--lr", "1e-3", "--iterations-to-skip", "5", "6", "--bf16", "--min-lr", "-1"]
    assert set_flag(["--lr", "1", "--x"], "--lr", ["2"]) == ["--x", "--lr", "2"]


def test_apply_edit_set_remove_scale_at_least():
    args = ["--lr", "0.004", "--min-lr", "0.0004", "--mechmon-drill-at", "12", "--moe-aux-loss-coeff", "0.1"]
    edit = Edit(set={"--fa-fp32-o": ()}, remove=("--mechmon-drill-at",), scale={"--lr": 0.5, "--min-lr": 0.5},
                at_least={"--moe-aux-loss-coeff": 0.01, "--moe-z-loss-coeff": 0.001})
    out = apply_edit(args, edit)
    assert flag_values(out.args, "--lr") == ["0.002"] and flag_values(out.args, "--min-lr") == ["0.0002"]
    assert flag_values(out.args, "--fa-fp32-o") == [] and flag_values(out.args, "--mechmon-drill-at") is None
    assert flag_values(out.args, "--moe-aux-loss-coeff") == ["0.1"]  # already larger: kept
    assert flag_values(out.args, "--moe-z-loss-coeff") == ["0.001"]
    assert "--mechmon-drill-at 12" in out.removed and "--fa-fp32-o" in out.added
    again = apply_edit(out.args, Edit(set={"--fa-fp32-o": ()}))
    assert again.args == out.args and again.notes  # already in effect: said, not duplicated
    missing = apply_edit(["--save", "s"], Edit(scale={"--lr": 0.5}))
    assert missing.args == ["--save", "s"] and "not in the command" in missing.notes[0]


def test_skip_window_and_checkpoint_flags():
    out = apply_edit(["--save", "s"], Edit(set={"--iterations-to-skip": ("{skip_window}",)}), skip_window=[11, 12])
    assert flag_values(out.args, "--iterations-to-skip") == ["11", "12"]
    args = select_checkpoint_flags(["--load", "/other", "--save", "s"], "/abs/s", "--ckpt-step", "10")
    assert flag_values(args, "--load") == ["/abs/s"] and flag_values(args, "--ckpt-step") == ["10"]
    removed, added = diff_flags(["--load", "/other", "--lr", "1"],
                                ["--lr", "1", "--load", "/abs/s", "--ckpt-step", "10"])
    assert removed == ["--load /other"] and added == ["--load /abs/s", "--ckpt-step 10"]


def test_the_supervisor_loads_no_torch():
    import subprocess

    code = ("import sys, mechmon_megatron.supervise.cli, mechmon_megatron.supervise.loop; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'deepspeed')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
