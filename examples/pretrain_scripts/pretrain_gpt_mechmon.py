"""Pre-train a small GPT / GPT-MoE with megatron-core, monitored by mechmon.

    python examples/pretrain_scripts/pretrain_gpt_mechmon.py --train-iters 200 \
        --mechmon --mechmon-interval 10 --mechmon-delta 10 --tensorboard-dir runs/tb
    torchrun --nproc-per-node 2 examples/pretrain_scripts/pretrain_gpt_mechmon.py \
        --tensor-model-parallel-size 2 --sequence-parallel --mechmon ...

The same trainer is installed with the package: ``python -m gpt_trainer ...``.
Flags: Megatron-LM names (see gpt_trainer/args.py), ``--attention-backend`` and the ``--fa-*``
fault flags (gpt_trainer/attention.py), and ``--mechmon*`` (mechmon_megatron/cli/args.py).
"""

import sys

from gpt_trainer.monitored import run  # gpt_trainer/ sits beside this script

if __name__ == "__main__":  # the checkpoint writer's spawned helper re-imports this module
    sys.exit(run())
