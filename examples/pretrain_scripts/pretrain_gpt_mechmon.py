"""Pre-train a small GPT / GPT-MoE with megatron-core, monitored by mechmon.

    python examples/pretrain_scripts/pretrain_gpt_mechmon.py --train-iters 200 \
        --mechmon --mechmon-interval 10 --mechmon-delta 10 --tensorboard-dir runs/tb
    torchrun --nproc-per-node 2 examples/pretrain_scripts/pretrain_gpt_mechmon.py \
        --tensor-model-parallel-size 2 --sequence-parallel --mechmon ...

Flags: Megatron-LM names (see gpt_trainer/args.py), ``--attention-backend`` and the ``--fa-*``
fault flags (gpt_trainer/attention.py), and ``--mechmon*`` (mechmon_megatron/cli/args.py).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # gpt_trainer/
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # repository root (mechmon_megatron)

from gpt_trainer import build_parser, main  # noqa: E402

from mechmon_megatron.adapters.mcore.callback import MechmonCallback  # noqa: E402
from mechmon_megatron.cli.args import add_mechmon_args, config_from_args, validate_mechmon_args  # noqa: E402


def run(argv=None) -> int:
    providers = [add_mechmon_args]
    # Fail fast, naming the flag, before any process group or model exists.
    parser = build_parser(providers)
    validate_mechmon_args(parser, parser.parse_args(argv))
    return main(argv, providers, callbacks_factory=lambda args: [MechmonCallback(config_from_args(args))])


if __name__ == "__main__":  # the checkpoint writer's spawned helper re-imports this module
    sys.exit(run())
