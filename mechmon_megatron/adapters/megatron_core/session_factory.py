"""Build a monitoring session for megatron-core model chunks (any TP / PP / EP / DP layout).

The one place this host looks up the process's collective guard (``collective_guard.guard()``):
the communicator, the sites, the main-parameter readers and the session all receive it from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from mechmon_megatron.adapters.megatron_core.discovery import find_left_out, find_modules, unwrap
from mechmon_megatron.adapters.megatron_core.main_params import weight_reader
from mechmon_megatron.adapters.megatron_core.sites import attention_sites, router_sites
from mechmon_megatron.detect.phase_moments import TrainingSchedule
from mechmon_megatron.session import collective_guard
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import Communicator, LocalCommunicator, TorchDistributedCommunicator
from mechmon_megatron.session.host_settings import graphed_router
from mechmon_megatron.session.log import mechmon_log
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.startup import graphed_router_message, log_left_out, log_monitoring
from mechmon_megatron.session.writers import JsonlScalarWriter, ScalarWriter, TensorBoardScalarWriter, WriterGroup

log = mechmon_log(__name__)

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


@dataclass
class McoreReads:
    """What the host does around the session's reads (filled by :func:`build_mcore_session`).

    ``router_reads``: collective reads (mechmon's own, through the guard) every rank runs, in
    order, after the optimizer step of a check step and before ``session.on_step_end`` (the
    sharded FP32 main router weights, gathered to the reporting rank). ``model_weights``: sites
    that read model parameters, which are stale right after the step under
    ``overlap_param_gather``; only then does the host gather every parameter first
    (``force_param_sync``). Under ``--mechmon-weights main`` with the
    optimizer's FP32 main parameters there are none.
    """

    router_reads: list[Callable[[], None]] = field(default_factory=list)
    model_weights: int = 0

    @property
    def needs_param_sync(self) -> bool:
        return self.model_weights > 0

    def run_prefetch(self, iteration: int) -> None:
        """Every rank, check steps: the prefetch reads; a failure (the same on every rank of the
        group, collective_guard) leaves the weight missing, which the check then counts."""
        for fetch in self.router_reads:
            try:
                fetch()
            except Exception as exc:  # noqa: BLE001 -- a monitor read never stops training
                log.warning("iteration %d: router weight prefetch failed: %s: %s", iteration, type(exc).__name__, exc)


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
    reads: Optional[McoreReads] = None,
    schedule: Optional[TrainingSchedule] = None,
) -> MonitoringSession:
    """Discover attention layers and routers in ``model_chunks`` and attach a session.

    Call on every rank after the model is built (and wrapped in DDP). ``host_tensorboard`` is
    the host's ``SummaryWriter`` (Megatron creates it on the last rank only); ``writer_rank``
    is the global rank that writes (default: last, matching Megatron). ``extra_writers`` (e.g.
    W&B) are used on the writer rank only. ``optimizer``: the megatron-core optimizer, whose FP32
    main parameters are read under ``--mechmon-weights main`` (without it: the model weights, with
    a notice). ``reads``: filled with what the host must do around a check (:class:`McoreReads`).
    ``schedule``: the job's learning-rate schedule (``lr_schedule.schedule_of_args``), which the
    early-phase correction compares with its calibration's; None: unknown, the correction is off.
    """
    if not config.enabled:
        return MonitoringSession(config)
    distributed = dist.is_available() and dist.is_initialized()
    guard = collective_guard.guard()  # this process's; passed to everything below
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
        # The records travel to one owner per TP group first, then the owners to the writer.
        comm: Communicator = TorchDistributedCommunicator(writer_rank=writer_rank, owner_group=tp_group, guard=guard)
    else:
        tp_group, dp_rank, dp, tp_rank, reduce_group, dp_group = None, 0, 1, 0, None, None
        comm = LocalCommunicator(guard)
    layer_names = {id(param): f"layer {item.layer_number} ({item.name}.{name})"
                   for item in found_attention for name, param in item.module.named_parameters()}
    notices: set[str] = set()

    def weight_source(param: torch.nn.Parameter):
        # Decided at start-up from the layout only, so every DP rank agrees on collective reads.
        reader, source = weight_reader(param, optimizer, dp_group, layer=layer_names.get(id(param), ""),
                                       setting=config.weights, notices=notices, guard=guard)
        if source == "model" and reads is not None:
            reads.model_weights += 1
        return reader

    def router_weight(router: torch.nn.Module) -> Callable[[], torch.Tensor]:
        # The FP32 main router weight where the optimizer keeps one: no model-wide parameter
        # gather is then needed before a check. A sharded one (distributed optimizer) is gathered
        # to the reporting rank, on every rank, by the host's prefetch before the session runs.
        name = f"router of {router_names[id(router)]}"
        reader, source = weight_reader(router.weight, optimizer, dp_group, layer=name, setting=config.weights,
                                       notices=notices, guard=guard)
        if source == "model":
            if reads is not None:
                reads.model_weights += 1
            return lambda _m=router: _m.weight
        if not reader.collective:
            return reader
        reader.configure_use(reporting, None)
        fetched: dict[str, torch.Tensor] = {}

        def fetch() -> None:
            value = reader()
            if value is not None:
                fetched["weight"] = value

        def read() -> torch.Tensor:
            if "weight" not in fetched:  # never a collective here: only the reporting rank reads
                raise RuntimeError(f"{reader.layer}: the main router weight was not prefetched for this check")
            return fetched.pop("weight")

        if reads is not None:
            reads.router_reads.append(fetch)
        return read

    router_names = {id(item.module): f"layer {item.layer_number} ({item.name})" for item in found_routers}
    reporting = dp_rank == 0 and tp_rank == 0
    holder: dict[str, MonitoringSession] = {}
    # Every rank lists its stage's layers: the work is spread over the DP x TP ranks (sites.py).
    left_out = find_left_out(model_chunks) if "attn" in config.monitors else []
    attn = attention_sites(found_attention, tp_group, config.full_matrix_dw, dp_rank=dp_rank, dp=dp,
                           weight_source=weight_source, left_out=left_out, guard=guard)
    routers = router_sites(
        found_routers,
        reduce_group,
        reports=reporting,
        capture_enabled=lambda: holder["session"].capturing,
        weight_source=router_weight if optimizer is not None else None,
        guard=guard,
    )
    writer = build_writer(config, comm.is_writer, host_tensorboard, tensorboard_dir)
    if comm.is_writer:
        writer.writers.extend(extra_writers)
    session = MonitoringSession(config, attn, routers, comm=comm, writer=writer, guard=guard, schedule=schedule)
    holder["session"] = session
    _notice(config, attn, found_routers)
    if reporting:  # one rank per pipeline stage names its stage's layers
        log_left_out(left_out)
    if config.short_window and any(item.kind == "mla" for item in found_attention) and reporting:
        log.info("--mechmon-short-window: multi-head latent attention layers are checked on the long window only")
    return session


def _notice(config: MechmonConfig, attention: list, found_routers: list) -> None:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    # The start-up lines every host prints (session/startup.py), rank 0 only.
    log_monitoring(config, len(attention), len(found_routers), rank,
                   attention_kind="self-attention (linear_qkv or multi-head latent)", router_kind="MoE router")
