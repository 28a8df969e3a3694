"""A small megatron-core GPT / GPT-MoE trainer (CPU gloo or GPU nccl), one job per file:

``args`` (flags), ``data`` (corpus, sampler), ``model`` (config, layer spec, init, DDP),
``checkpoint`` (dist_checkpointing), ``callbacks`` (hook API), ``metrics`` (TensorBoard, JSONL),
``runtime`` (process groups, seeds), ``loop`` (training), ``main`` (wiring), ``attention``
(the ``--attention-backend`` registry), ``attention_variants`` (multi-head latent attention,
QK-norm), ``monitored`` (the trainer with the mechmon monitors; ``python -m gpt_trainer``).

Installed with mechmon-megatron as the top-level package ``gpt_trainer`` (setup.py maps it from
``examples/pretrain_scripts/gpt_trainer``), so it runs from a non-editable install too.
"""

from .args import build_parser
from .callbacks import ExitRequest, TrainContext
from .main import main

__all__ = ["ExitRequest", "TrainContext", "build_parser", "main"]
