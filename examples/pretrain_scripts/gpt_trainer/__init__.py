"""A small megatron-core GPT / GPT-MoE trainer (CPU gloo or GPU nccl), one job per file:

``args`` (flags), ``data`` (corpus, sampler), ``model`` (config, layer spec, init, DDP),
``checkpoint`` (dist_checkpointing), ``callbacks`` (hook API), ``metrics`` (TensorBoard, JSONL),
``runtime`` (process groups, seeds), ``loop`` (training), ``main`` (wiring).
"""

from .callbacks import ExitRequest, TrainContext
from .args import build_parser
from .main import main

__all__ = ["ExitRequest", "TrainContext", "build_parser", "main"]
