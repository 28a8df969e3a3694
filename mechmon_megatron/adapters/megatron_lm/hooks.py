"""``MegatronLMHooks``: drive one monitoring session from Megatron-LM's training loop.

The hooks build the session on the first training step (model chunks and writers exist then,
``--load`` is done), arm router-logit capture before the forward of a check step, run the check
after the optimizer step, and turn an agreed abort into Megatron's own save-and-exit
(``args.exit_interval = iteration``).

mechmon's state, ``session.state_dict()`` (mechmon's one format, ``session/state_format.py``; the
writer rank's holds the detectors), is saved per rank:

* ``--ckpt-format torch_dist`` (Megatron's default): inside Megatron's own distributed checkpoint,
  one ``ShardedObject`` per rank under ``mechmon`` (:meth:`MegatronLMHooks.sharded_entry`, added
  to ``generate_state_dict``'s result), read back by Megatron's load
  (:meth:`MegatronLMHooks.add_load_entry` / :meth:`MegatronLMHooks.take_loaded`) and applied when
  the session is built. A torch_dist checkpoint without the entry (older mechmon) still loads:
  the per-rank JSON files below, or the single file, are read then, with one notice.
* ``--ckpt-format torch`` (legacy; only data-parallel rank 0 writes the model): every rank writes
  ``iter_XXXXXXX/mechmon_state/rank_RRRRR.json`` after the save and reads its own on resume.

The older ``iter_XXXXXXX/mechmon_state.json`` (the writer's state only) still loads, with one
notice (its reader, like every reader of an older layout, is ``session/state_format.py``).
:mod:`.install` wires these hooks into ``megatron.training.training`` and
``megatron.training.checkpointing``. The hooks' own collective (the barrier before an abort's
exit) runs through the session's collective guard.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, Sequence

import torch

from mechmon_megatron.adapters.megatron_core import (
    McoreReads,
    add_load_template,
    build_mcore_session,
    force_param_sync,
    loaded_state,
    schedule_of_args,
    state_shard,
)
from mechmon_megatron.cli.args import config_from_args
from mechmon_megatron.session.collective_guard import CollectiveFailure, CollectiveGuard, CollectivesOff
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.log import mechmon_log
from mechmon_megatron.session.rollback_reach import missing_saves_notice
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.state_format import MEGATRON_LM_SINGLE_FILE, STATE_KEY, megatron_lm_file_state
from mechmon_megatron.session.writers import WandbScalarWriter

log = mechmon_log(__name__)

STATE_DIR = "mechmon_state"
"""Per-rank state files under ``iter_XXXXXXX/``: ``rank_RRRRR.json`` (``--ckpt-format torch``; beside a
torch_dist checkpoint only from an older mechmon)."""
STATE_FILENAME = MEGATRON_LM_SINGLE_FILE
"""The older single file of the writer rank's state (mechmon <= 0.3): still read on resume."""
DIST_FORMAT = "torch_dist"
"""Megatron's ``--ckpt-format`` whose checkpoint holds mechmon's state itself."""


def in_dist_checkpoint(args: Any) -> bool:
    """mechmon's state goes into Megatron's distributed checkpoint (``--ckpt-format torch_dist``);
    other formats (``torch``: written by data-parallel rank 0 only) keep the per-rank JSON files."""
    return getattr(args, "ckpt_format", None) == DIST_FORMAT


def checkpoint_iter_dir(save_dir: str, iteration: int, release: bool = False, checkpointing: Any = None) -> str:
    """Megatron's ``iter_XXXXXXX`` (or ``release``) directory of ``iteration`` under ``save_dir``, by
    ``checkpointing.get_checkpoint_name`` (default: ``megatron.training.checkpointing``'s) where it exists."""
    get_name = getattr(checkpointing, "get_checkpoint_name", None)
    if get_name is None:
        try:
            from megatron.training.checkpointing import get_checkpoint_name as get_name
        except ImportError:  # no Megatron-LM
            get_name = None
    if callable(get_name):
        try:
            return str(get_name(save_dir, iteration, release=release, return_base_dir=True))
        except TypeError:  # a release without return_base_dir
            pass
    return os.path.join(save_dir, "release" if release else f"iter_{iteration:07d}")


def rollback_reach_line(args: Any, config: MechmonConfig) -> Optional[str]:
    """The start-up line (after the ``[mechmon]`` prefix) when an abort could not be rolled back to
    before its change point (``session.rollback_reach.missing_saves_notice``); None when the saves
    can reach back (Megatron-LM deletes no persistent checkpoint) or the action is not
    checkpoint-and-abort."""
    if config.action != "checkpoint-and-abort":
        return None
    line = missing_saves_notice(getattr(args, "save", None), getattr(args, "save_interval", None),
                                config.interval, config.delta)
    return f"--mechmon-action {line}" if line else None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() \
        else 0


def state_path(directory: str, rank: int) -> str:
    """This rank's state file in Megatron's ``iter_XXXXXXX`` directory."""
    return os.path.join(directory, STATE_DIR, f"rank_{rank:05d}.json")


def write_state(directory: str, state: dict, rank: Optional[int] = None) -> str:
    """Write this rank's session state as JSON under :data:`STATE_KEY`, atomically (``os.replace``)."""
    path = state_path(directory, _rank() if rank is None else rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({STATE_KEY: state}, f, allow_nan=True)
    os.replace(tmp, path)
    return path


def read_state(directory: str, rank: Optional[int] = None, older: bool = False) -> Optional[dict]:
    """This rank's state file, or the older single file's (one notice), or None
    (``state_format.megatron_lm_file_state``).

    ``older``: the per-rank files are themselves the older layout (beside a torch_dist checkpoint
    that lacks the ``mechmon`` entry): one notice too."""
    return megatron_lm_file_state(state_path(directory, _rank() if rank is None else rank), directory, older)


def _barrier(guard: CollectiveGuard) -> None:
    try:
        guard.barrier(None, "the barrier before the abort's exit")
    except (CollectiveFailure, CollectivesOff) as exc:  # bounded by --mechmon-collective-timeout
        log.error("%s; exiting without it", exc)


class MegatronLMHooks:
    """Drives one ``MonitoringSession`` from Megatron-LM's training loop (one per process).

    Host dependencies are passed in, so the hooks run on real megatron-core models without
    ``megatron.training`` (tests): ``get_args`` returns Megatron's args namespace;
    ``get_tensorboard_writer`` / ``get_wandb_writer`` return the host writers or None;
    ``session_builder(config, model_chunks, host_tensorboard, tensorboard_dir)`` builds the session.
    """

    def __init__(
        self,
        get_args: Callable[[], Any],
        get_tensorboard_writer: Callable[[], Any] = lambda: None,
        get_wandb_writer: Callable[[], Any] = lambda: None,
        session_builder: Optional[Callable[..., MonitoringSession]] = None,
    ) -> None:
        self._get_args = get_args
        self._get_tensorboard_writer = get_tensorboard_writer
        self._get_wandb_writer = get_wandb_writer
        self._session_builder = session_builder
        self.config: Optional[MechmonConfig] = None
        self.session: Optional[MonitoringSession] = None
        self.abort_iteration: Optional[int] = None
        self.exit_code: Optional[int] = None
        self.optimizer: Any = None
        """Megatron's optimizer (from ``train_step``): its FP32 main parameters are what we read."""
        self.reads = McoreReads()
        """What to do around a check (prefetch, whether to gather the model first): session_factory."""
        self.loaded: Optional[tuple[str, Optional[dict]]] = None
        """(checkpoint dir, this rank's state) read by Megatron's load of a torch_dist checkpoint,
        applied when the session is built at the first training step."""

    # -- lifecycle
    def ensure_session(
        self, model_chunks: Sequence[torch.nn.Module], start_iteration: int
    ) -> Optional[MonitoringSession]:
        """Build the session once (first train step), restore state saved with ``--load``."""
        if self.session is not None or self.config is not None:
            return self.session
        args = self._get_args()
        self.config = config_from_args(args)
        if not self.config.enabled:
            return None
        wandb_run = self._get_wandb_writer()
        common = dict(host_tensorboard=self._get_tensorboard_writer(),
                      tensorboard_dir=getattr(args, "tensorboard_dir", None),
                      extra_writers=[WandbScalarWriter(wandb_run)] if wandb_run is not None else [])
        if self._session_builder is not None:
            session = self._session_builder(self.config, list(model_chunks), **common)
        else:
            session = build_mcore_session(self.config, list(model_chunks), writer_rank=-1, optimizer=self.optimizer,
                                          reads=self.reads, schedule=schedule_of_args(args), **common)
        self.session = session
        line = rollback_reach_line(args, self.config)
        if line:
            log.warning(line, rank=0)
        self._restore(args, start_iteration)
        session.on_train_start(start_iteration)
        return session

    def _restore(self, args: Any, start_iteration: int) -> None:
        loaded, self.loaded = self.loaded, None
        load = getattr(args, "load", None)
        if not load or start_iteration <= 0:
            return
        directory = checkpoint_iter_dir(load, start_iteration)
        if loaded is not None:  # the entry of Megatron's distributed checkpoint
            directory, state = loaded
        else:
            state = read_state(directory, older=in_dist_checkpoint(args))
        if state is None:
            log.info("no mechmon state (the %r entry, %s/ or %s) in %s: detectors start with a fresh baseline",
                     STATE_KEY, STATE_DIR, STATE_FILENAME, directory)
            return
        session = self.session
        session.load_state_dict(state)
        # The state was taken before its own save was recorded: the run resumes from that checkpoint.
        if not any(c.get("iteration") == start_iteration for c in session.checkpoints):
            session.on_checkpoint_saved(start_iteration, checkpoint_iter_dir(load, start_iteration))
        log.info("restored detector state from %s", directory)

    # -- Megatron's distributed checkpoint (--ckpt-format torch_dist)
    def sharded_entry(self, args: Any) -> Any:
        """This rank's shard of the ``mechmon`` entry for a torch_dist save, or None (no session,
        monitors off, or another checkpoint format)."""
        session = self.session
        if session is None or not session.enabled or not in_dist_checkpoint(args):
            return None
        return state_shard(session.state_dict())

    def add_load_entry(self, args: Any, template: dict, checkpoint_dir: str) -> bool:
        """Name this rank's ``mechmon`` shard in Megatron's load template when the checkpoint holds
        it (an older checkpoint without it must load unchanged); True when added."""
        if not getattr(args, "mechmon", False) or not isinstance(template, dict):
            return False
        return add_load_template(template, checkpoint_dir)

    def take_loaded(self, loaded: Any, checkpoint_dir: str) -> None:
        """Keep this rank's state from what Megatron's load returned (applied at the first step)."""
        if isinstance(loaded, dict) and STATE_KEY in loaded:  # popped: Megatron sees its own state dict only
            self.loaded = (checkpoint_dir, loaded_state({STATE_KEY: loaded.pop(STATE_KEY)}, checkpoint_dir))

    # -- per step
    def before_step(self, model_chunks: Sequence[torch.nn.Module], iteration: int) -> None:
        """Before the forward of step ``iteration`` (1-based: the value after this step)."""
        session = self.ensure_session(model_chunks, iteration - 1)
        if session is not None:
            session.on_step_start(iteration)

    def after_forward_backward(self) -> None:
        """The training step returned: stop capturing (evaluation forwards must not count)."""
        if self.session is not None and self.session.enabled:
            self.session.stop_capture()

    def after_step(self, model_chunks: Sequence[torch.nn.Module], iteration: int) -> bool:
        """After the optimizer step of ``iteration``; True when the job must save and exit."""
        session = self.session
        if session is None or not session.enabled:
            return False
        config = session.config
        args = self._get_args()
        reads_weights = config.is_check_step(iteration) or config.is_snapshot_step(iteration)
        if (
            reads_weights
            and self.reads.needs_param_sync  # FP32 main parameters (--mechmon-weights main) are current
            and getattr(args, "use_distributed_optimizer", False)
            and getattr(args, "overlap_param_gather", False)
        ):
            session.run_host_collective("read", iteration, lambda: force_param_sync(model_chunks),
                                        "the forced parameter all-gather (overlap_param_gather)")
        if config.is_check_step(iteration):
            self.reads.run_prefetch(iteration)
        decision = session.on_step_end(iteration)
        if not decision.abort:
            return False
        # Every rank holds the same decision (one broadcast in the session): all set the same exit.
        self.abort_iteration = iteration
        self.exit_code = decision.exit_code
        args.exit_interval = iteration
        if not getattr(args, "save", None):
            log.warning("checkpoint-and-abort without --save: Megatron exits without a checkpoint")
        return True

    def after_save(self, iteration: int, non_persistent: bool = False) -> None:
        """After ``save_checkpoint`` of ``iteration`` returned on this rank."""
        session = self.session
        if session is None or not session.enabled or non_persistent:
            return
        save = getattr(self._get_args(), "save", None)
        if not save:
            return
        directory = checkpoint_iter_dir(save, iteration)
        session.on_checkpoint_saved(iteration, directory)
        if not in_dist_checkpoint(self._get_args()):  # torch_dist: the state is inside the checkpoint
            write_state(directory, session.state_dict())  # every rank its own (errors, checkpoints; detector: writer)

    def finish_abort(self) -> Optional[str]:
        """After Megatron left the loop for our abort: write the alert, sync, close."""
        save = getattr(self._get_args(), "save", None)
        directory = checkpoint_iter_dir(save, self.abort_iteration) if save else None
        path = self.session.on_abort_checkpoint_saved(self.abort_iteration, directory)
        _barrier(self.session.guard)  # no rank exits (and makes the launcher kill the writer) before the alert exists
        self.close()
        return path

    def close(self) -> None:
        if self.session is not None:
            self.session.close()



