"""The ``--mechmon*`` flags as Megatron-LM ``extra_args_provider`` functions."""

from __future__ import annotations

import argparse
from typing import Optional

from mechmon_megatron.cli.args import ArgsProvider, add_mechmon_args


def has_mechmon_flags(parser: argparse.ArgumentParser) -> bool:
    """True when ``parser`` already has ``--mechmon`` (a patched script's provider added it)."""
    return "--mechmon" in getattr(parser, "_option_string_actions", {})


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds the ``--mechmon*`` flags (once per parser), and keeps
    the host's ``--help`` printable (:func:`escape_stray_percent`)."""
    escape_stray_percent(parser)
    return parser if has_mechmon_flags(parser) else add_mechmon_args(parser)


def escape_stray_percent(parser: argparse.ArgumentParser) -> list[str]:
    """Escape a lone ``%`` in any help text argparse cannot expand; returns the flags fixed.

    argparse formats each help text with ``%``-style formatting, so a help such as megatron-core
    0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` ("... (e.g. 1.10 = 10%).") makes
    ``--help`` raise ``ValueError``. mechmon-supervise reads the host's flags from ``--help``: it
    could not supervise such a release at all. Only texts that fail to expand are touched."""
    formatter = parser._get_formatter()
    fixed = []
    for action in parser._actions:
        if not action.help or action.help is argparse.SUPPRESS:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")
            fixed.extend(action.option_strings[:1])
    return fixed


def with_mechmon_flags(existing: Optional[ArgsProvider] = None) -> ArgsProvider:
    """One provider adding ``existing``'s flags (e.g. ModelOpt's, may be None), then ours unless
    ``existing`` already did: a patched script started through ``mechmon-run`` gets them once."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if existing is not None:
            parser = existing(parser) or parser
        return add_arguments(parser)

    return provider


def extra_args_provider(existing: Optional[ArgsProvider] = None) -> ArgsProvider:
    """What the patched ``pretrain_gpt.py`` passes: ``existing``'s flags and ours (see above)."""
    return with_mechmon_flags(existing)
