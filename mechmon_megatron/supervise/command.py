"""The launch command as a token list: where the host's own flags start, and flag edits.

Pure functions on ``list[str]``. A launcher's options (torchrun, the DeepSpeed launcher, srun,
the Python interpreter's) come before the training program; the host's flags come after it.
Edits only touch the host part, so a launcher option named like a host flag is never changed.
A flag's values are the tokens after it up to the next ``--`` token (``--iterations-to-skip 5 6``).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

TORCHRUN_BOOLEAN = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--module",
                    "-m", "--virtual-local-rank", "--virtual_local_rank"}
"""torchrun options that take no value (every other one takes one, unless written ``--opt=value``)."""
DEEPSPEED_BOOLEAN = {"--no_python", "--no-python", "--module", "-m", "--no_local_rank", "--force_multi",
                     "--elastic_training", "--bind_cores_to_rank", "--save_pid", "--no_ssh_check", "--no_ssh"}
SRUN_SHORT_WITH_VALUE = {"-N", "-n", "-c", "-p", "-t", "-J", "-A", "-q", "-w", "-o", "-e", "-G"}
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch",
                    "nvidia_resiliency_ext.fault_tolerance.launcher")
"""Launchers with torchrun's options: the last is nvidia-resiliency-ext's ``ft_launcher`` (torchrun's
options plus ``--ft-*`` ones, each with a value)."""
TORCHRUN_LIKE = ("torchrun", "ft_launcher")
SCRIPT_WRAPPERS = ("mechmon_megatron.adapters.megatron_lm.run", "mechmon-run",
                   "mechmon_megatron.testing.megatron_lm_cpu")
"""Programs whose first argument is the training script (``mechmon-run pretrain_gpt.py ...``):
the host's flags start after that script, and ``--help`` goes to it. The last is ``mechmon-run``
on CPU, from a checkout's testing package (never imported here)."""


class CommandError(ValueError):
    """The command cannot be understood (no program, no --save)."""


@dataclass(frozen=True)
class LaunchCommand:
    """``argv[host_start:]`` are the host's flags; ``help_argv`` prints the host's parser."""

    argv: tuple[str, ...]
    host_start: int
    help_argv: tuple[str, ...]
    launcher: str
    """``torchrun``, ``deepspeed``, ``python`` or ``direct`` (an executable of its own)."""

    @property
    def host_args(self) -> list[str]:
        return list(self.argv[self.host_start:])

    def with_host_args(self, host_args: Sequence[str]) -> LaunchCommand:
        return LaunchCommand(argv=(*self.argv[: self.host_start], *host_args), host_start=self.host_start,
                             help_argv=self.help_argv, launcher=self.launcher)


def _shebang_python(executable: str) -> str:
    """The interpreter a console script (``torchrun``, ``deepspeed``) runs under, else ours."""
    path = shutil.which(executable) or executable
    try:
        with open(path, "rb") as f:
            first = f.readline().decode("utf-8", "replace").strip()
    except OSError:
        return sys.executable
    if first.startswith("#!") and "python" in first:
        return first[2:].split()[0]
    return sys.executable


def _skip_options(argv: Sequence[str], i: int, boolean: set[str]) -> tuple[int, bool, bool]:
    """Skip a launcher's options from ``i``; returns (index of the program, module?, no-python?)."""
    module = no_python = False
    while i < len(argv) and argv[i].startswith("-"):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in ("-m", "--module"):
            module = True
        if name in ("--no-python", "--no_python"):
            no_python = True
        i += 1 if ("=" in token or name in boolean) else 2
    return i, module, no_python


def _python_program(argv: Sequence[str], i: int) -> tuple[int, list[str]]:
    """``python [opts] (-m MOD | script)``: index after the program, and the program's argv."""
    j = i
    while j < len(argv) and argv[j].startswith("-") and argv[j] != "-m":
        j += 2 if argv[j] in ("-X", "-W") else 1
    if j < len(argv) and argv[j] == "-m":
        if j + 1 >= len(argv):
            raise CommandError("the command has -m but no module")
        return j + 2, [*argv[:i], *argv[i:j + 2]]
    if j >= len(argv):
        raise CommandError("the command names no training script")
    return j + 1, [*argv[:j + 1]]


def parse_command(argv: Sequence[str]) -> LaunchCommand:
    """Find the training program in ``argv`` and how to ask it for ``--help``."""
    command = _parse_command(list(argv))
    program = os.path.basename(command.argv[command.host_start - 1])
    if program in SCRIPT_WRAPPERS:
        if command.host_start >= len(command.argv):
            raise CommandError(f"{program} is followed by no training script")
        script = command.argv[command.host_start]
        return LaunchCommand(argv=command.argv, host_start=command.host_start + 1,
                             help_argv=(*command.help_argv[:-1], script, "--help"), launcher=command.launcher)
    return command


def _parse_command(argv: list[str]) -> LaunchCommand:
    if not argv:
        raise CommandError("no command after --")
    i = 0
    while os.path.basename(argv[i]) == "srun":  # inside an sbatch script: srun [opts] LAUNCH...
        i += 1
        while i < len(argv) and argv[i].startswith("-"):
            i += 2 if argv[i] in SRUN_SHORT_WITH_VALUE else 1
        if i >= len(argv):
            raise CommandError("srun is followed by no command")
    name = os.path.basename(argv[i])
    launcher, boolean, python = "direct", set(), None
    if name in TORCHRUN_LIKE:
        launcher, boolean, python, i = "torchrun", TORCHRUN_BOOLEAN, _shebang_python(argv[i]), i + 1
    elif name == "deepspeed":
        launcher, boolean, python, i = "deepspeed", DEEPSPEED_BOOLEAN, _shebang_python(argv[i]), i + 1
    elif name.startswith("python"):
        if argv[i + 1:i + 3] and argv[i + 1] == "-m" and len(argv) > i + 2 and argv[i + 2] in TORCHRUN_MODULES:
            launcher, boolean, python, i = "torchrun", TORCHRUN_BOOLEAN, argv[i], i + 3
        else:
            end, program = _python_program(argv, i + 1)
            return LaunchCommand(argv=tuple(argv), host_start=end, help_argv=(argv[i], *program[i + 1:], "--help"),
                                 launcher="python")
    else:
        return LaunchCommand(argv=tuple(argv), host_start=i + 1, help_argv=(argv[i], "--help"), launcher="direct")
    j, module, no_python = _skip_options(argv, i, boolean)
    if j >= len(argv):
        raise CommandError(f"{launcher} is followed by no training script")
    if module:
        help_argv: tuple[str, ...] = (str(python), "-m", argv[j], "--help")
    elif no_python:
        help_argv = (argv[j], "--help")
    else:
        help_argv = (str(python), argv[j], "--help")
    return LaunchCommand(argv=tuple(argv), host_start=j + 1, help_argv=help_argv, launcher=launcher)


def _span(args: Sequence[str], k: int) -> int:
    """Index after the values of the flag at ``k``."""
    if "=" in args[k]:
        return k + 1
    end = k + 1
    while end < len(args) and not args[end].startswith("--"):
        end += 1
    return end


def flag_values(args: Sequence[str], flag: str) -> Optional[list[str]]:
    """Values of the last ``flag`` in ``args`` (``[]`` for a bare flag), None when absent."""
    found: Optional[list[str]] = None
    for k, token in enumerate(args):
        if token == flag:
            found = list(args[k + 1:_span(args, k)])
        elif token.startswith(flag + "="):
            found = [token.split("=", 1)[1]]
    return found


def remove_flag(args: Sequence[str], flag: str) -> list[str]:
    """``args`` without any ``flag`` and its values."""
    out: list[str] = []
    k = 0
    while k < len(args):
        if args[k] == flag or args[k].startswith(flag + "="):
            k = _span(args, k)
            continue
        out.append(args[k])
        k += 1
    return out


def set_flag(args: Sequence[str], flag: str, values: Sequence[str]) -> list[str]:
    """``args`` with ``flag`` given exactly once, with ``values`` (none: a bare switch), at the end."""
    return [*remove_flag(args, flag), flag, *values]


def host_flag_names(args: Sequence[str]) -> list[str]:
    """The ``--flags`` named in ``args``, in order (``--a=1`` gives ``--a``)."""
    return [t.split("=", 1)[0] for t in args if t.startswith("--") and len(t) > 2]
