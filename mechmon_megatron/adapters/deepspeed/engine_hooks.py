"""Attach a monitoring session to a DeepSpeed engine (``MechmonDeepSpeed``).

DeepSpeed has no callback API -- the user owns the loop -- so the adapter wraps three methods on
the engine INSTANCE (the class is untouched):

``engine.step``
    After the original step, on steps where the update was applied (``was_step_applied()``,
    i.e. gradient-accumulation boundaries without fp16 overflow), run the session for iteration
    ``engine.global_steps``; then arm router capture for the next iteration. An overflow (a
    boundary whose update was skipped: ``global_steps`` advanced, nothing applied) re-arms it;
    a micro-step inside the accumulation (``global_steps`` unchanged) leaves the capture as it is,
    so a check step's router statistics sum over all its micro-batches.
``engine.save_checkpoint``
    DeepSpeed writes ``client_state`` from the saving rank(s) only (the model-states file), so
    every rank's ``session.state_dict()`` (the detector baselines on the writer rank, each rank's
    error count and checkpoint list) is first gathered to rank 0 and broadcast back (guarded
    collectives on mechmon's own group, bounded by ``collective_timeout``), and the user's own
    client state gains ``client_state["mechmon"] = {"format": "mechmon-per-rank-1", "ranks":
    {rank: state}}`` (``session/state_format.py``). The checkpoint is then recorded for the alert's
    "last checkpoint before the first warning". The abort checkpoint of checkpoint-and-abort holds
    the user's client state too, taken from ``client_state_fn()`` (passed to ``attach``), plus
    ``client_state["mechmon_alert"]``, the content of ``mechmon_alert.json`` (``AlertReport.to_json``).
``engine.load_checkpoint``
    Each rank restores its own state from the loaded ``client_state`` (no second warm-up; the
    older single state of the saving rank loads on every rank, with one notice) and restarts the
    schedule at the loaded step.

Who computes what:
* Attention: every rank lists every attention layer (reads may be ZeRO collectives); the heads
  and full-matrix dW of layer L are computed on rank ``(L - 1) % world`` only (round-robin).
* QK-norms (``qk_norms.py``): their gammas are read with the layer's Q/K weights, by the same
  reader, on the same ranks, and folded into the per-head rows the owner reports.
* Routers: token statistics are summed over the ranks that see distinct tokens (the
  data-parallel group: the whole world for plain DP and for expert parallelism without tensor
  parallelism); global rank 0 reports. The gate weight is replicated (EP shards experts only).
* Scalars are written by global rank 0 through ``engine.monitor`` (DeepSpeed's monitor writes on
  rank 0 only), plus ``log_dir`` (JSONL, and TensorBoard when the engine has none).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mechmon_megatron.adapters.deepspeed.attention_layouts import FoundAttention, find_attention, layer_numbers
from mechmon_megatron.adapters.deepspeed.config import PREFIX, checked_startup, checkpoint_dir_of, key_of
from mechmon_megatron.adapters.deepspeed.gate_capture import find_gates, install_gate_capture
from mechmon_megatron.adapters.deepspeed.qk_norms import fold_rows
from mechmon_megatron.adapters.deepspeed.weights import read_full_param, read_is_collective
from mechmon_megatron.detect.phase_moments import TrainingSchedule
from mechmon_megatron.session.collective_guard import CollectiveFailure, CollectiveGuard, CollectivesOff
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import (
    AttentionSite,
    FullQK,
    LocalCommunicator,
    QKWeights,
    RouterSite,
    SnapshotBudget,
    TorchDistributedCommunicator,
    process_guard,
)
from mechmon_megatron.session.log import mechmon_log
from mechmon_megatron.session.session import Decision, MonitoringSession
from mechmon_megatron.session.startup import (
    RunFacts,
    StartupReport,
    log_monitoring,
    log_startup_warnings,
)
from mechmon_megatron.session.state_format import STATE_KEY, own_state, per_rank, state_of
from mechmon_megatron.session.writers import (
    EventListWriter,
    JsonlScalarWriter,
    ScalarWriter,
    TensorBoardScalarWriter,
    WriterGroup,
)

log = mechmon_log(__name__)

CLIENT_STATE_KEY = STATE_KEY  # mechmon's one key on every host (session/state_format.py)
CLIENT_ALERT_KEY = "mechmon_alert"
MECHMON_CLIENT_KEYS = (CLIENT_STATE_KEY, CLIENT_ALERT_KEY)
"""client_state keys mechmon writes; a user's own client state must not use them."""
JSONL_NAME = "mechmon_scalars.jsonl"
WRITER_RANK = 0  # DeepSpeed's MonitorMaster writes on global rank 0 only


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


class _AttentionReader:
    """Per-check reads of one attention layer; rank ``owner`` reports it.

    ``read_param``: how a parameter is read (None: the ZeRO-aware fp32 read, ``weights.py``). The
    layer's QK-norm weights are read with it, after the Q/K weights, on the same ranks. ``guard``
    times a ZeRO read (the host's collective) and names it when it fails.
    """

    def __init__(self, found: FoundAttention, owner: bool, full_matrix: bool,
                 read_param: Optional[Callable[[torch.nn.Parameter], torch.Tensor]] = None, *,
                 guard: CollectiveGuard) -> None:
        self.found = found
        self.guard = guard
        self.owner = owner
        self.full_matrix = full_matrix
        self.read_param = read_param
        self.collective = any(read_is_collective(p) for p in (*found.params, *found.norm_params))
        self._cache: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]] = None

    def budget(self) -> SnapshotBudget:
        """FP32 master weights of the owner's Q + K rows (heads and full matrix are the same rows)."""
        f = self.found
        param = f.params[0]
        shape = tuple(getattr(param, "ds_shape", param.shape))
        hidden = int(min(shape)) if f.layout == "gpt2_c_attn" else int(shape[-1])
        elements = (f.num_heads + f.num_groups) * f.head_dim * hidden if self.owner else 0
        return SnapshotBudget(heads_elements=elements, full_elements=elements if self.full_matrix else 0,
                              shared=True, element_size=4, device=param.device)

    def _read(self, read_param: Callable[[torch.nn.Parameter], torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        wq, wk = self.found.read(read_param)
        return (wq, wk, *self.found.read_norms(read_param))

    def read_full(self) -> Optional[FullQK]:
        # The session calls read_full first on every rank; do the (possibly collective) read here.
        # A ZeRO read is the host's collective (DeepSpeed's groups), issued for the monitors.
        self._cache = (self.guard.host_collective(lambda: self._read(self.read_param or read_full_param),
                                                  f"the ZeRO read of {self.found.name}")
                       if (self.owner or self.collective) else None)
        if not (self.owner and self.full_matrix):
            return None
        wq, wk = self._cache[:2]
        return FullQK(wq=wq.reshape(-1, wq.shape[-1]), wk=wk.reshape(-1, wk.shape[-1]))

    def read_heads(self) -> Optional[QKWeights]:
        cache, self._cache = self._cache, None
        if not self.owner:
            return None
        if cache is None:  # never re-read here: the read may be a collective the peers have left
            raise RuntimeError(f"{self.found.name}: read_heads called without a successful read_full")
        wq, wk, q_gamma, k_gamma = cache
        wq, q_norm = fold_rows(wq, self.found.q_norm, q_gamma)
        wk, k_norm = fold_rows(wk, self.found.k_norm, k_gamma)
        return QKWeights(wq=wq, wk=wk, head_offset=0, q_norm=q_norm, k_norm=k_norm)


class _RouterReader:
    """Reduction and (prefetched) weight of one TopKGate."""

    def __init__(self, gate: torch.nn.Module, group: Any, guard: CollectiveGuard) -> None:
        self.gate = gate
        self.group = group
        self.guard = guard
        guard.declare(group)  # mechmon's own copy is made when the session starts
        self.weight: Optional[torch.Tensor] = None

    def prefetch(self) -> None:
        """Every rank, on check steps: the session reads the weight on the reporting rank only."""
        self.weight = read_full_param(self.gate.wg.weight)

    def read_weight(self) -> torch.Tensor:
        weight, self.weight = self.weight, None
        return weight if weight is not None else self.gate.wg.weight.detach().float()

    def reduce_sum(self, vector: torch.Tensor) -> torch.Tensor:
        if not _distributed() or dist.get_world_size(self.group) == 1:
            return vector.cpu()
        device = self.gate.wg.weight.device  # NCCL needs the accelerator tensor
        work = vector.to(device=device, dtype=torch.float64)
        self.guard.all_reduce(work, self.group, "the router all-reduce of a gate")
        return work.cpu()


def _token_group(engine: Any) -> tuple[Any, bool]:
    """(group that sees distinct tokens, this rank reports): world without an mpu."""
    mpu = getattr(engine, "mpu", None)
    if mpu is None or not hasattr(mpu, "get_data_parallel_group"):
        return None, _rank() == 0
    group = mpu.get_data_parallel_group()
    mp_rank = mpu.get_model_parallel_rank() if hasattr(mpu, "get_model_parallel_rank") else 0
    return group, dist.get_rank(group) == 0 and mp_rank == 0


def _tensor_parallel(engine: Any) -> int:
    mpu = getattr(engine, "mpu", None)
    if mpu is not None and hasattr(mpu, "get_model_parallel_world_size"):
        return int(mpu.get_model_parallel_world_size())
    return 1


class MechmonDeepSpeed:
    """The monitoring session attached to one DeepSpeed engine (see the module docstring).

    Build with :func:`mechmon_megatron.deepspeed.attach`. Public: ``session``, ``config``,
    ``restore(client_state)``, ``load_checkpoint(...)``, ``state_dict()``, ``detach()``. ``guard``:
    the process's collective guard (``attach`` looks it up; default: the process's), which the
    communicator, the readers and every session of this engine receive.
    """

    def __init__(self, engine: Any, config: MechmonConfig, checkpoint_dir: Optional[str] = None,
                 client_state_fn: Optional[Callable[[], Mapping[str, Any]]] = None,
                 guard: Optional[CollectiveGuard] = None, lr_schedule: Optional[TrainingSchedule] = None) -> None:
        self.engine = engine
        self.config = config
        self.lr_schedule = lr_schedule
        self.checkpoint_dir = checkpoint_dir or checkpoint_dir_of(config)
        self.client_state_fn = client_state_fn
        self._last_save_dir: Optional[str] = None
        self._handles: list = []
        self._originals: dict[str, Any] = {}
        self.guard = process_guard(guard)
        if not config.enabled:
            self.session = MonitoringSession(config)  # disabled: allocates nothing, no hooks
            return
        report = self._validate_abort_inputs()  # bad input is refused here, before any hook or allocation
        log_startup_warnings(report, _rank(), spell=key_of)  # the trainer logs these at its parse
        # No tensor parallelism here: the reporting ranks send their records straight to the writer (one level).
        self.comm = (TorchDistributedCommunicator(writer_rank=WRITER_RANK, guard=self.guard) if _distributed()
                     else LocalCommunicator(self.guard))
        model = engine.module
        self._attention_sites = self._build_attention_sites(model) if "attn" in config.monitors else []
        self._routers: list[_RouterReader] = []
        self._router_sites = self._build_router_sites(model) if "router" in config.monitors else []
        self.writer = self._build_writer()
        self.session = self._new_session()
        self._armed = False
        self._start(int(engine.global_steps))
        self._wrap("step", self._step)
        self._wrap("save_checkpoint", self._save_checkpoint)
        self._wrap("load_checkpoint", self._load_checkpoint)
        # The start-up lines every host prints (session/startup.py), rank 0 only.
        log_monitoring(config, len(self._attention_sites), len(self._router_sites), _rank(),
                       attention_kind=f"self-attention (a known Q/K layout, or {PREFIX}.attention_mapping)",
                       router_kind="deepspeed.moe TopKGate")

    # ------------------------------------------------------------------ construction
    def _build_attention_sites(self, model: torch.nn.Module) -> list[AttentionSite]:
        found = find_attention(model, self.config.extra.get("attention_mapping", ()), notice=_rank() == 0)
        if found and _tensor_parallel(self.engine) > 1:
            log.warning("tensor-parallel attention (mpu) is not supported by the DeepSpeed adapter: attention "
                        "monitors skipped", rank=0)
            return []
        sites = []
        for found_one, layer in zip(found, layer_numbers([f.name for f in found])):
            reader = _AttentionReader(
                found_one, owner=(layer - 1) % _world() == _rank(), full_matrix=self.config.full_matrix_dw,
                guard=self.guard,
            )
            sites.append(AttentionSite(layer, reader.read_heads, reader.read_full, found_one.name,
                                       snapshot_budget=reader.budget(), reports=reader.owner))
        return sites

    def _build_router_sites(self, model: torch.nn.Module) -> list[RouterSite]:
        gates = list(find_gates(model))
        group, reports = _token_group(self.engine)
        sites = []
        for (name, gate), layer in zip(gates, layer_numbers([n for n, _ in gates])):
            reader = _RouterReader(gate, group, self.guard)
            site = RouterSite(
                layer_number=layer,
                num_experts=int(
                    gate.wg.weight.shape[0] if not hasattr(gate.wg.weight, "ds_shape") else gate.wg.weight.ds_shape[0]
                ),
                topk=int(gate.k),
                weight=reader.read_weight,
                reduce_sum=reader.reduce_sum,
                reports=reports,
                name=name,
            )
            self._handles.append(install_gate_capture(gate, site, lambda: self.session.capturing))
            self._routers.append(reader)
            sites.append(site)
        return sites

    def _build_writer(self) -> WriterGroup:
        if not self.comm.is_writer:
            return WriterGroup()
        writers: list[ScalarWriter] = []
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            writers.append(EventListWriter(monitor))
        if self.config.log_dir:
            writers.append(JsonlScalarWriter(os.path.join(self.config.log_dir, JSONL_NAME)))
            if getattr(monitor, "tb_monitor", None) is None:
                writers.append(TensorBoardScalarWriter.in_directory(self.config.log_dir))
        if not writers:
            log.warning("no output: enable a DeepSpeed monitor (tensorboard / csv_monitor / wandb) or set "
                        "mechmon.log_dir")
        return WriterGroup(writers)

    def _new_session(self) -> MonitoringSession:
        return MonitoringSession(
            self.config, self._attention_sites, self._router_sites, comm=self.comm, writer=self.writer,
            guard=self.guard, schedule=self.lr_schedule,
        )

    def _wrap(self, method: str, replacement) -> None:
        original = getattr(self.engine, method)
        self._originals[method] = original
        setattr(self.engine, method, functools.wraps(original)(functools.partial(replacement, original)))

    def _validate_abort_inputs(self) -> StartupReport:
        """The start-up check of every host (``session/startup.py``) with checkpoint-and-abort's
        folder, and the user's client state, at ``attach``; returns the check's warnings.

        ``ValueError`` naming the key: no folder to save to (``checkpoint_dir`` / ``log_dir``) or
        one this process cannot write; a ``client_state_fn`` that is not callable, raises, or
        returns something other than a mapping, or a mapping with one of mechmon's own keys.
        """
        if self.client_state_fn is not None:
            if not callable(self.client_state_fn):
                raise ValueError(f"attach(client_state_fn=...) must be a callable returning the user's client_state "
                                 f"dict, got {type(self.client_state_fn).__name__}")
            user_client_state(self.client_state_fn, "attach(client_state_fn=...)")
        abort = self.config.action == "checkpoint-and-abort"
        directory = self.checkpoint_dir or self.config.log_dir
        flag = f"{PREFIX}.checkpoint_dir (attach(checkpoint_dir=...) or {PREFIX}.log_dir)"
        # the start-up rule of every host, on the folder the abort will really use
        report = checked_startup(self.config, RunFacts(save_dir=directory, save_flag=flag if abort else None))
        if abort and self.client_state_fn is None:
            log.info("the checkpoint-and-abort checkpoint holds no client state of the training loop (sampler "
                     "position, counters): pass attach(engine, client_state_fn=...) to include it", rank=0)
        return report

    def _start(self, iteration: int) -> None:
        self.session.on_train_start(iteration)
        self.session.on_step_start(iteration + 1)

    # ------------------------------------------------------------------ wrapped engine methods
    def _step(self, original, *args, **kwargs):
        before = int(self.engine.global_steps)
        out = original(*args, **kwargs)
        after = int(self.engine.global_steps)
        if after == before:
            return out  # a micro-step inside the accumulation: the check step's capture goes on
        if self.engine.was_step_applied():
            self._after_step(after)
        else:  # an overflow skipped the update: re-arm (a fresh summary) for the next iteration
            self.session.on_step_start(after + 1)
        return out

    def _after_step(self, iteration: int) -> None:
        if self.config.is_check_step(iteration):
            for router in self._routers:  # collective reads on every rank, before the session's reads
                self.session.run_host_collective("router", iteration, router.prefetch,
                                                 "the ZeRO read of a gate weight")
        decision = self.session.on_step_end(iteration)
        if decision.abort:
            self._abort(decision)
        self.session.on_step_start(iteration + 1)

    def _save_checkpoint(self, original, save_dir, tag=None, client_state=None, *args, **kwargs):
        merged = dict(client_state or {})
        taken = sorted(set(merged) & {CLIENT_STATE_KEY})
        if taken:  # refused before anything is written: the user's value would be replaced silently
            raise ValueError(f"engine.save_checkpoint(client_state=...): key(s) {taken} are mechmon's "
                             f"(the monitor state); rename them in your client state")
        merged[CLIENT_STATE_KEY] = self._every_rank_state()
        out = original(save_dir, tag, merged, *args, **kwargs)
        self._last_save_dir = str(save_dir)
        step = int(self.engine.global_steps)
        self.session.on_checkpoint_saved(step, os.path.join(str(save_dir), str(tag or f"global_step{step}")))
        return out

    def _every_rank_state(self) -> dict:
        """Every rank's state (:func:`per_rank`), on every rank: the saving ranks are DeepSpeed's.

        All ranks call ``save_checkpoint`` (DeepSpeed requires it), so all take part. A failed or
        skipped gather (mechmon's collectives down) saves this rank's own state only: the others
        then start afresh on resume, training goes on."""
        state = self.session.state_dict()
        if not _distributed() or _world() == 1:
            return per_rank({_rank(): state})
        try:
            states = self.guard.gather_objects(state, 0, None, "the gather of every rank's mechmon state for a save")
            states = self.guard.broadcast_object(states, 0, None, "the broadcast of every rank's mechmon state")
        except (CollectiveFailure, CollectivesOff) as exc:
            log.error("rank %d: %s; this checkpoint holds this rank's mechmon state only", _rank(), exc)
            return per_rank({_rank(): state})
        return per_rank(dict(enumerate(states)))

    def _load_checkpoint(self, original, *args, **kwargs):
        load_path, client_state = original(*args, **kwargs)
        if load_path is not None:
            self.restore(client_state or {})
        return load_path, client_state

    # ------------------------------------------------------------------ public
    def restore(self, client_state: dict) -> None:
        """Restore detector state from a loaded ``client_state`` and restart the schedule at the
        engine's current step. ``engine.load_checkpoint`` calls this itself once attached."""
        if not self.config.enabled:
            return
        self.session = self._new_session()  # fresh snapshots: the weights changed
        where = "the loaded client_state"
        self.session.load_state_dict(own_state(state_of(client_state, where), _rank(), where) or {})
        self._start(int(self.engine.global_steps))

    def load_checkpoint(self, *args, **kwargs):
        """``engine.load_checkpoint(...)`` with the detector state restored; returns its result."""
        return self.engine.load_checkpoint(*args, **kwargs)

    def state_dict(self) -> dict:
        return self.session.state_dict()

    def detach(self) -> None:
        """Remove the hooks and method wrappers and close the writers."""
        for handle in self._handles:
            handle.remove()
        for method, original in self._originals.items():
            setattr(self.engine, method, original)
        for _, gate in find_gates(self.engine.module):
            gate._mechmon_capture = False
        self._handles, self._originals = [], {}
        self.session.close()

    # ------------------------------------------------------------------ abort
    def _abort_dir(self) -> str:
        directory = self.checkpoint_dir or self._last_save_dir or self.config.log_dir
        if directory is None:
            raise ValueError(
                "mechmon checkpoint-and-abort needs a directory: set ds_config.mechmon.checkpoint_dir "
                "(or call engine.save_checkpoint once, or set ds_config.mechmon.log_dir)"
            )
        return directory

    def _abort(self, decision: Decision) -> None:
        """Every rank: save a checkpoint with the alert, write mechmon_alert.json, exit."""
        iteration = decision.iteration
        directory = self._abort_dir()
        tag = f"global_step{iteration}"
        # The content of mechmon_alert.json (``session/alert.py``), so the checkpoint carries its alarm.
        alert = self.session.abort_report(iteration, os.path.join(directory, tag)).to_json()
        client_state: dict[str, Any] = {}
        if self.client_state_fn is not None:
            try:  # validated at attach; a failure now still saves the model, without the user's part
                client_state = user_client_state(self.client_state_fn, "client_state_fn()")
            except ValueError as exc:
                log.error("rank %d: %s; the abort checkpoint is saved without it", _rank(), exc)
        client_state[CLIENT_ALERT_KEY] = alert
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state)
        self.session.on_abort_checkpoint_saved(iteration, os.path.join(directory, tag))
        self.session.close()
        if _distributed():
            try:
                self.guard.barrier(None, "the barrier before the abort's exit")
            except (CollectiveFailure, CollectivesOff) as exc:  # bounded by ds_config.mechmon.collective_timeout
                log.error("%s; exiting without it", exc)
            # Leave together, with no collective in flight (gloo threads abort otherwise).
            dist.destroy_process_group()
        if self.comm.is_writer:
            log.error(
                "checkpoint saved in %s; exiting with code %d",
                os.path.join(directory, tag),
                decision.exit_code,
            )
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(decision.exit_code)


def user_client_state(fn: Callable[[], Mapping[str, Any]], where: str) -> dict[str, Any]:
    """``fn()`` as a plain dict, checked: a mapping, none of whose keys is one of mechmon's.

    ``ValueError`` naming ``where`` otherwise (also when ``fn`` raises).
    """
    try:
        state = fn()
    except Exception as exc:  # noqa: BLE001 -- reported as bad input, naming the callback
        raise ValueError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, Mapping):
        raise ValueError(f"{where} must return a dict (the user's client_state), got {type(state).__name__}")
    taken = sorted(set(state) & set(MECHMON_CLIENT_KEYS))
    if taken:
        raise ValueError(f"{where} returns key(s) {taken}, which mechmon writes into the checkpoint's client_state "
                         f"itself ({', '.join(MECHMON_CLIENT_KEYS)}); rename them in your client state")
    return dict(state)
