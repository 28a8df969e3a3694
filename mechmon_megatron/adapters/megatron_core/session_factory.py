"""Build a monitoring session for megatron-core model chunks (any TP / PP / EP / DP layout)."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from mechmon_megatron.adapters.megatron_core.discovery import find_modules, unwrap
from mechmon_megatron.adapters.megatron_core.main_params import weight_reader
from mechmon_megatron.adapters.megatron_core.sites import attention_sites, router_sites
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import LocalCommunicator, TorchDistributedCommunicator
from mechmon_megatron.session.host_settings import graphed_router
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.startup import graphed_router_message
from mechmon_megatron.session.writers import JsonlScalarWriter, ScalarWriter, TensorBoardScalarWriter, WriterGroup

logger = logging.getLogger(__name__)

JSONL_NAME = "mechmon_scalars.jsonl"


def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def _sequence_parallel(model_chunks: Sequence[torch.nn.Module]) -> bool:
    for chunk in model_chunks:
        cfg = getattr(unwrap(chunk), "config", None)
        if cfg is not None:
            return bool(getattr(cfg, "sequence_parallel", False))
    return False


def build_writer(
    config: MechmonConfig, is_writer: bool, host_tensorboard: Any = None, tensorboard_dir: Optional[str] = None
) -> WriterGroup:
    """Writer-rank outputs: the host's TensorBoard writer if it has one, else our own in
    ``--mechmon-log-dir`` (or ``--tensorboard-dir``); plus a JSONL copy in the log dir."""
    if not is_writer:
        return WriterGroup()
    writers: list[ScalarWriter] = []
    if host_tensorboard is not None:
        writers.append(TensorBoardScalarWriter(host_tensorboard))
    elif config.log_dir or tensorboard_dir:
        writers.append(TensorBoardScalarWriter.in_directory(config.log_dir or tensorboard_dir))
    if config.log_dir:
        writers.append(JsonlScalarWriter(os.path.join(config.log_dir, JSONL_NAME)))
    return WriterGroup(writers)


def build_mcore_session(
    config: MechmonConfig,
    model_chunks: Sequence[torch.nn.Module],
    host_tensorboard: Any = None,
    tensorboard_dir: Optional[str] = None,
    writer_rank: int = -1,
    extra_writers: Sequence[ScalarWriter] = (),
    optimizer: Any = None,
) -> MonitoringSession:
    """Discover attention layers and routers in ``model_chunks`` and attach a session.

    Call on every rank after the model is built (and wrapped in DDP). ``host_tensorboard`` is
    the host's ``SummaryWriter`` (Megatron creates it on the last rank only); ``writer_rank``
    is the global rank that writes (default: last, matching Megatron). ``extra_writers`` (e.g.
    W&B) are used on the writer rank only. ``optimizer``: the megatron-core optimizer, whose FP32
    main parameters are read under ``--mechmon-weights main`` (without it: the model weights, with
    a notice).
    """
    if not config.enabled:
        return MonitoringSession(config)
    distributed = dist.is_available() and dist.is_initialized()
    found_attention, found_routers = find_modules(model_chunks)
    if "router" in config.monitors:
        for item in found_routers:  # the same rule as the parse-time check, on the model's own config
            graphed = graphed_router(getattr(item.module, "config", None))
            if graphed:
                raise ValueError(graphed_router_message(graphed))
    if distributed:
        ps = _parallel_state()
        tp_group = ps.get_tensor_model_parallel_group()
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        tp_rank = ps.get_tensor_model_parallel_rank()
        if _sequence_parallel(model_chunks):
            reduce_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        else:
            reduce_group = ps.get_data_parallel_group(with_context_parallel=True)
        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        comm = TorchDistributedCommunicator(writer_rank=writer_rank)
    else:
        tp_group, dp_rank, dp, tp_rank, reduce_group, dp_group = None, 0, 1, 0, None, None
        comm = LocalCommunicator()
    layer_names = {id(item.module.linear_qkv.weight): f"layer {item.layer_number} ({item.name})"
                   for item in found_attention}
    notices: set[str] = set()

    def weight_source(param: torch.nn.Parameter):
        # Decided at start-up from the layout only, so every DP rank agrees on collective reads.
        reader, _ = weight_reader(param, optimizer, dp_group, layer=layer_names.get(id(param), ""),
                                  setting=config.weights, notices=notices)
        return reader

    holder: dict[str, MonitoringSession] = {}
    # Every rank lists its stage's layers: the work is spread over the DP x TP ranks (sites.py).
    attn = attention_sites(found_attention, tp_group, config.full_matrix_dw, dp_rank=dp_rank, dp=dp,
                           weight_source=weight_source)
    routers = router_sites(
        found_routers,
        reduce_group,
        reports=(dp_rank == 0 and tp_rank == 0),
        capture_enabled=lambda: holder["session"].capturing,
    )
    writer = build_writer(config, comm.is_writer, host_tensorboard, tensorboard_dir)
    if comm.is_writer:
        writer.writers.extend(extra_writers)
    session = MonitoringSession(config, attn, routers, comm=comm, writer=writer)
    holder["session"] = session
    _notice(config, found_attention, found_routers)
    return session


def _notice(config: MechmonConfig, found_attention: list, found_routers: list) -> None:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        return
    if "attn" in config.monitors and not found_attention:
        logger.warning("[mechmon] no self-attention (linear_qkv) found on rank 0: attention monitors idle there")
    if "router" in config.monitors and not found_routers:
        logger.warning("[mechmon] no MoE router found on rank 0: router monitors idle (dense model?)")
    logger.info(
        "[mechmon] monitoring %d attention layers and %d routers on rank 0 (interval %d, delta %d, action %s)",
        len(found_attention),
        len(found_routers),
        config.interval,
        config.delta,
        config.action,
    )
