"""The monitoring session as a training-loop callback for megatron-core loops.

Any loop that calls these hooks on every rank gets the monitors: the example trainer
(``examples/pretrain_scripts/gpt_trainer``) uses it directly; the Megatron-LM adapter drives the
same session from ``post_training_step_callbacks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mechmon_megatron.adapters.megatron_core.lr_schedule import schedule_of_args
from mechmon_megatron.adapters.megatron_core.param_sync import force_param_sync, overlaps_param_gather
from mechmon_megatron.adapters.megatron_core.session_factory import McoreReads, build_mcore_session
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.session import MonitoringSession


@dataclass
class MechmonExitRequest:
    """Returned from ``on_step_end`` when the loop must save on every rank and exit."""

    save: bool
    exit_code: int
    reason: str


class MechmonCallback:
    """Owns one ``MonitoringSession`` built when training starts (model chunks exist then)."""

    name = "mechmon"

    def __init__(self, config: MechmonConfig, writer_rank: int = -1) -> None:
        self.config = config
        self.writer_rank = writer_rank
        self.session: Optional[MonitoringSession] = None
        self._pending_state: Optional[dict] = None
        self._abort_iteration: Optional[int] = None
        self._model_chunks: list = []
        self.reads = McoreReads()

    # ctx: TrainContext of the loop (args, model_chunks, optimizer, iteration, tensorboard_writer)
    def on_train_start(self, ctx: Any) -> None:
        tensorboard_dir = getattr(getattr(ctx, "args", None), "tensorboard_dir", None)
        self._model_chunks = list(ctx.model_chunks)
        self.reads = McoreReads()
        self.session = build_mcore_session(
            self.config,
            ctx.model_chunks,
            host_tensorboard=getattr(ctx, "tensorboard_writer", None),
            tensorboard_dir=tensorboard_dir,
            writer_rank=self.writer_rank,
            optimizer=getattr(ctx, "optimizer", None),
            reads=self.reads,
            schedule=schedule_of_args(getattr(ctx, "args", None)),
        )
        if self._pending_state:
            self.session.load_state_dict(self._pending_state)
            self._pending_state = None
        self.session.on_train_start(int(ctx.iteration))

    def on_step_start(self, iteration: int) -> None:
        if self.session is not None:
            self.session.on_step_start(iteration)

    def on_step_end(self, iteration: int, ctx: Any = None) -> Optional[MechmonExitRequest]:
        if self.session is None:
            return None
        cfg = self.session.config
        reads = cfg.is_check_step(iteration) or cfg.is_snapshot_step(iteration)
        # Only reads of model parameters need the whole model gathered first; the FP32 main
        # parameters (--mechmon-weights main) are current right after the step.
        if reads and self.reads.needs_param_sync and overlaps_param_gather(self._model_chunks):
            # The host's own all-gather, issued for the monitors: inside the failure log, by the schedule.
            chunks = self._model_chunks
            self.session.run_host_collective("read", iteration, lambda: force_param_sync(chunks),
                                             "the forced parameter all-gather (overlap_param_gather)")
        if cfg.is_check_step(iteration):
            self.reads.run_prefetch(iteration)
        decision = self.session.on_step_end(iteration)
        if not decision.abort:
            return None
        self._abort_iteration = iteration
        reason = "; ".join(a.describe() for a in decision.alerts) or "mechmon alarm (details on the writer rank)"
        return MechmonExitRequest(save=True, exit_code=decision.exit_code, reason=reason)

    def on_checkpoint_saved(self, iteration: int, checkpoint_dir: Optional[str]) -> None:
        if self.session is not None:
            self.session.on_checkpoint_saved(iteration, checkpoint_dir)

    def on_exit(self, request: Any, checkpoint_dir: Optional[str]) -> None:
        if self.session is not None and self._abort_iteration is not None:
            self.session.on_abort_checkpoint_saved(self._abort_iteration, checkpoint_dir)
        self.close()

    def close(self) -> None:
        if self.session is not None:
            self.session.close()

    def state_dict(self) -> dict:
        return self.session.state_dict() if self.session is not None else (self._pending_state or {})

    def load_state_dict(self, state: dict) -> None:
        if self.session is not None:
            self.session.load_state_dict(state)
        else:
            self._pending_state = dict(state)
