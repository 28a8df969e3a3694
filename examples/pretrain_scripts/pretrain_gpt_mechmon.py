"""Pre-train a small GPT / GPT-MoE with megatron-core (see README.md in this folder).

    torchrun --nproc-per-node 2 examples/pretrain_scripts/pretrain_gpt_mechmon.py \
        --tensor-model-parallel-size 2 --sequence-parallel --train-iters 20
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # gpt_trainer/
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # repository root (mechmon_megatron)

from gpt_trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
