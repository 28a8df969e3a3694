"""The ``--mechmon*`` flags as Megatron-LM ``extra_args_provider`` functions."""

from __future__ import annotations

import argparse
from typing import Optional

from mechmon_megatron.cli.args import ArgsProvider, add_mechmon_args, chain_providers


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds the ``--mechmon*`` flags."""
    return add_mechmon_args(parser)


def extra_args_provider(existing: Optional[ArgsProvider] = None) -> ArgsProvider:
    """One provider adding ``existing``'s flags (e.g. ModelOpt's, may be None) and ours."""
    return chain_providers(existing, add_mechmon_args)
