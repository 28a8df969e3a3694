"""The example trainer with the mechmon monitors attached: ``run(argv)``.

Entry points (the same function): ``python -m gpt_trainer ...`` (the package is installed with
mechmon-megatron, so the fault study and the benchmarks start it by module) and
``python examples/pretrain_scripts/pretrain_gpt_mechmon.py ...`` from a source checkout.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from mechmon_megatron.adapters.megatron_core import MechmonCallback
from mechmon_megatron.cli.args import add_mechmon_args, config_from_args, validate_mechmon_args

from .args import build_parser
from .main import main


def run(argv: Optional[Sequence[str]] = None) -> int:
    providers = [add_mechmon_args]
    # As main() configures it: the start-up check's warnings below print as every later line does.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Fail fast, naming the flag, before any process group or model exists.
    parser = build_parser(providers)
    validate_mechmon_args(parser, parser.parse_args(argv))
    return main(argv, providers, callbacks_factory=lambda args: [MechmonCallback(config_from_args(args))])
