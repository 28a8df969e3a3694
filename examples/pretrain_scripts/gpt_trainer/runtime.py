"""Process group, model-parallel groups, threads and seeds."""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(args: argparse.Namespace) -> None:
    """``init_process_group`` from torchrun's env vars (a plain ``python`` run is world size 1),
    then megatron-core's model-parallel groups."""
    if "RANK" not in os.environ:  # not launched by torchrun: a single process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(args.num_threads or 1)
    torch.distributed.init_process_group(
        backend=args.distributed_backend,
        timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )


def set_seeds(seed: int) -> None:
    """Megatron-LM's seeding: offset by pipeline rank, tensor-parallel RNG tracker states."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
