"""The host's flags, read from its own ``--help`` before the first launch."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Sequence

_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][A-Za-z0-9_-]*)")
_CHOICES = re.compile(r"(--[A-Za-z0-9][A-Za-z0-9_-]*)[ =]\{([^}]*)\}")
HELP_TIMEOUT_S = 300.0
"""Megatron-LM imports torch, apex and TE before it parses: a cold start can take minutes."""


class HostError(ValueError):
    """The host's parser could not be read."""


@dataclass(frozen=True)
class HostFlags:
    flags: frozenset[str]
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Flags with fixed choices (argparse prints ``--flag {a,b,c}``)."""

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def accepts(self, flag: str, value: str) -> bool:
        allowed = self.choices.get(flag)
        return allowed is None or value in allowed


def parse_help(text: str) -> HostFlags:
    """Flags and choices named in an argparse ``--help`` text."""
    choices = {m.group(1): tuple(c.strip() for c in m.group(2).split(",")) for m in _CHOICES.finditer(text)}
    return HostFlags(flags=frozenset(_FLAG.findall(text)), choices=choices)


def read_host_flags(help_argv: Sequence[str], timeout_s: float = HELP_TIMEOUT_S) -> HostFlags:
    """Run ``help_argv`` (the program with ``--help``) and parse what it prints."""
    # A wide terminal keeps argparse from wrapping "--flag {a,b}" over two lines.
    env = {**os.environ, "COLUMNS": "400"}
    try:
        proc = subprocess.run(list(help_argv), capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostError(f"cannot read the host's flags with `{' '.join(help_argv)}`: {exc}") from None
    flags = parse_help(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not flags.flags:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise HostError(f"cannot read the host's flags: `{' '.join(help_argv)}` exited with {proc.returncode} "
                        f"({tail[0]})")
    return flags
