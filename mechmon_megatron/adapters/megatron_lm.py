"""Megatron-LM integration: ``--mechmon*`` flags, step hooks, writers, save-and-exit, state.

Two calls in ``pretrain_gpt.py`` (see ``patches/megatron-lm/``) attach the monitoring session to
an unmodified Megatron-LM training loop::

    from mechmon_megatron import megatron_lm as mechmon
    mechmon.install()
    pretrain(..., extra_args_provider=mechmon.extra_args_provider(existing_provider))

``install()`` wraps four module globals of ``megatron.training.training`` that ``pretrain`` /
``train`` look up at call time (present in Megatron-LM core_v0.16.x and current main):

* ``train_step``: builds the session on the first call (model chunks and writers exist then,
  ``--load`` is done), and arms router-logit capture before the forward of a check step
  (``session.on_step_start``); capture stops when the step returns, so evaluation forwards are
  never counted.
* ``post_training_step_callbacks``: after the optimizer step and ``iteration += 1``, on every
  rank, before ``checkpoint_and_decide_exit`` of the same iteration. Forces the parameter
  all-gather (``--use-distributed-optimizer --overlap-param-gather``) on steps that read weights,
  then runs ``session.on_step_end``. An agreed abort sets ``args.exit_interval = iteration`` on
  every rank, so Megatron's own ``checkpoint_and_decide_exit`` saves a checkpoint at this
  iteration (when ``--save`` is set) and leaves the loop.
* ``save_checkpoint``: after each persistent save, the writer rank (the last rank, which holds
  the detectors) writes ``mechmon_state.json`` into the ``iter_XXXXXXX`` directory; it is read
  back when a run resumes from that iteration with ``--load``.
* ``train``: Megatron ends an early exit with ``sys.exit(0)`` after the loop (async saves
  finalized first). When the exit was ours, the wrapper writes ``mechmon_alert.json`` beside the
  abort checkpoint, waits for the writer rank (barrier), and exits with ``--mechmon-exit-code``
  instead. Other exits (signal handler, ``--exit-interval``, rerun machine) pass through unchanged.

Scalars go to Megatron's own TensorBoard writer (``get_tensorboard_writer()``, last rank) and W&B
run (``get_wandb_writer()``) when they exist, else to ``--mechmon-log-dir``. Flags, scalar names
and the session are the same as for megatron-core loops (``adapters.mcore``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
from typing import Any, Callable, Optional, Sequence

import torch

from mechmon_megatron.adapters.mcore.param_sync import force_param_sync
from mechmon_megatron.cli.args import ArgsProvider, add_mechmon_args, chain_providers, config_from_args
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.writers import WandbScalarWriter

logger = logging.getLogger(__name__)

STATE_FILENAME = "mechmon_state.json"
TRAINING_MODULE = "megatron.training.training"
HOOKED = ("train_step", "post_training_step_callbacks", "save_checkpoint", "train")
_WRAPPED_MARK = "_mechmon_wrapped"


# ---------------------------------------------------------------------------- flags
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds the ``--mechmon*`` flags."""
    return add_mechmon_args(parser)


def extra_args_provider(existing: Optional[ArgsProvider] = None) -> ArgsProvider:
    """One provider adding ``existing``'s flags (e.g. ModelOpt's, may be None) and ours."""
    return chain_providers(existing, add_mechmon_args)


# ---------------------------------------------------------------------------- helpers
def checkpoint_iter_dir(save_dir: str, iteration: int) -> str:
    """Megatron's ``iter_XXXXXXX`` directory of ``iteration`` under ``save_dir``."""
    try:
        from megatron.training.checkpointing import get_checkpoint_name

        return get_checkpoint_name(save_dir, iteration, release=False, return_base_dir=True)
    except (ImportError, TypeError):  # release without return_base_dir, or no Megatron-LM
        return os.path.join(save_dir, f"iter_{iteration:07d}")


def write_state(directory: str, state: dict) -> str:
    """Write the session state as JSON, atomically (``os.replace``)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, STATE_FILENAME)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, allow_nan=True)
    os.replace(tmp, path)
    return path


def read_state(directory: str) -> Optional[dict]:
    path = os.path.join(directory, STATE_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# ---------------------------------------------------------------------------- the hooks
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

    # -- lifecycle
    def ensure_session(self, model_chunks: Sequence[torch.nn.Module], start_iteration: int) -> Optional[MonitoringSession]:
        """Build the session once (first train step), restore state saved with ``--load``."""
        if self.session is not None or self.config is not None:
            return self.session
        args = self._get_args()
        self.config = config_from_args(args)
        if not self.config.enabled:
            return None
        builder = self._session_builder or _default_builder
        wandb_run = self._get_wandb_writer()
        session = builder(
            self.config,
            list(model_chunks),
            host_tensorboard=self._get_tensorboard_writer(),
            tensorboard_dir=getattr(args, "tensorboard_dir", None),
            extra_writers=[WandbScalarWriter(wandb_run)] if wandb_run is not None else [],
        )
        self.session = session
        self._restore(args, start_iteration)
        session.on_train_start(start_iteration)
        return session

    def _restore(self, args: Any, start_iteration: int) -> None:
        load = getattr(args, "load", None)
        if not load or start_iteration <= 0:
            return
        directory = checkpoint_iter_dir(load, start_iteration)
        state = read_state(directory)
        if state is None:
            logger.info("[mechmon] no %s in %s: detectors start with a fresh baseline", STATE_FILENAME, directory)
            return
        self.session.load_state_dict(state)
        logger.info("[mechmon] restored detector state from %s", directory)

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
        if reads_weights and getattr(args, "use_distributed_optimizer", False) and getattr(args, "overlap_param_gather", False):
            force_param_sync(model_chunks)
        decision = session.on_step_end(iteration)
        if not decision.abort:
            return False
        # Every rank holds the same decision (one broadcast in the session): all set the same exit.
        self.abort_iteration = iteration
        self.exit_code = decision.exit_code
        args.exit_interval = iteration
        if not getattr(args, "save", None):
            logger.warning("[mechmon] checkpoint-and-abort without --save: Megatron exits without a checkpoint")
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
        if session.comm.is_writer:
            write_state(directory, session.state_dict())

    def finish_abort(self) -> Optional[str]:
        """After Megatron left the loop for our abort: write the alert, sync, close."""
        save = getattr(self._get_args(), "save", None)
        directory = checkpoint_iter_dir(save, self.abort_iteration) if save else None
        path = self.session.on_abort_checkpoint_saved(self.abort_iteration, directory)
        _barrier()  # no rank exits (and makes the launcher kill the writer) before the alert exists
        self.close()
        return path

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def _default_builder(config, model_chunks, host_tensorboard=None, tensorboard_dir=None, extra_writers=()) -> MonitoringSession:
    from mechmon_megatron.adapters.mcore.session_factory import build_mcore_session

    return build_mcore_session(config, model_chunks, host_tensorboard, tensorboard_dir, writer_rank=-1, extra_writers=extra_writers)


# ---------------------------------------------------------------------------- wrapping
def _step_iteration(args: tuple, kwargs: dict, get_args: Callable[[], Any]) -> int:
    """The 1-based iteration a ``train_step`` call is about to run."""
    done = kwargs.get("iteration")
    if done is None and len(args) > 7:
        done = args[7]
    if done is None:  # releases whose train_step has no iteration argument
        done = getattr(get_args(), "curr_iteration", 0)
    return int(done) + 1


def _model_arg(args: tuple, kwargs: dict, position: int) -> Any:
    return kwargs["model"] if "model" in kwargs else args[position]


def wrap_training_module(training: Any, hooks: MegatronLMHooks) -> None:
    """Replace the four hooked globals of ``training`` with wrappers calling ``hooks``."""
    missing = [name for name in HOOKED if not callable(getattr(training, name, None))]
    if missing:
        raise RuntimeError(
            f"mechmon: {training.__name__} has no {missing}; this Megatron-LM release is not supported "
            "by mechmon_megatron.megatron_lm.install() -- please report it with your Megatron-LM commit"
        )
    original = {name: getattr(training, name) for name in HOOKED}

    @functools.wraps(original["train_step"])
    def train_step(*args, **kwargs):
        # train_step(forward_step_func, data_iterator, model, optimizer, ..., iteration=None)
        hooks.before_step(_model_arg(args, kwargs, 2), _step_iteration(args, kwargs, hooks._get_args))
        try:
            return original["train_step"](*args, **kwargs)
        finally:
            hooks.after_forward_backward()

    @functools.wraps(original["post_training_step_callbacks"])
    def post_training_step_callbacks(*args, **kwargs):
        # (model, optimizer, opt_param_scheduler, iteration, ...): runs before the exit decision
        result = original["post_training_step_callbacks"](*args, **kwargs)
        iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
        hooks.after_step(_model_arg(args, kwargs, 0), int(iteration))
        return result

    @functools.wraps(original["save_checkpoint"])
    def save_checkpoint(*args, **kwargs):
        result = original["save_checkpoint"](*args, **kwargs)
        iteration = kwargs["iteration"] if "iteration" in kwargs else args[0]
        hooks.after_save(int(iteration), non_persistent=bool(kwargs.get("non_persistent_ckpt", False)))
        return result

    @functools.wraps(original["train"])
    def train(*args, **kwargs):
        try:
            result = original["train"](*args, **kwargs)
        except SystemExit:
            if hooks.abort_iteration is None:
                hooks.close()
                raise
            hooks.finish_abort()
            logger.warning("[mechmon] checkpoint-and-abort at iteration %d: exiting with code %d", hooks.abort_iteration, hooks.exit_code)
            raise SystemExit(hooks.exit_code) from None
        hooks.close()
        return result

    for name, fn in (
        ("train_step", train_step),
        ("post_training_step_callbacks", post_training_step_callbacks),
        ("save_checkpoint", save_checkpoint),
        ("train", train),
    ):
        setattr(fn, _WRAPPED_MARK, original[name])
        setattr(training, name, fn)


def unwrap_training_module(training: Any) -> None:
    """Undo :func:`wrap_training_module` (tests, in-process restarts)."""
    for name in HOOKED:
        fn = getattr(training, name, None)
        inner = getattr(fn, _WRAPPED_MARK, None)
        if inner is not None:
            setattr(training, name, inner)


def install(cpu_compat: Optional[bool] = None, training_module: Any = None) -> MegatronLMHooks:
    """Attach mechmon to Megatron-LM's training loop; call once, before ``pretrain``.

    Nothing is built until the first training step, and a run without ``--mechmon`` only pays
    for four pass-through wrappers. ``cpu_compat``: make megatron-core and Megatron-LM run on CPU
    (gloo; tests and laptops); ``None`` = when the environment sets ``MECHMON_CPU_COMPAT=1``
    and no GPU is present. Idempotent: a second call returns the installed hooks.
    """
    training = training_module or importlib.import_module(TRAINING_MODULE)
    installed = getattr(training, "_mechmon_hooks", None)
    if installed is not None:
        return installed
    if cpu_compat is None:
        cpu_compat = os.environ.get("MECHMON_CPU_COMPAT") == "1"
    if cpu_compat and not torch.cuda.is_available():
        from mechmon_megatron.adapters.megatron_lm_cpu import enable_megatron_lm_cpu_compat

        enable_megatron_lm_cpu_compat()
    from megatron.training import get_args
    from megatron.training import global_vars

    hooks = MegatronLMHooks(
        get_args=get_args,
        get_tensorboard_writer=global_vars.get_tensorboard_writer,
        get_wandb_writer=getattr(global_vars, "get_wandb_writer", lambda: None),
    )
    if _has_callback_api():
        logger.info("[mechmon] megatron.training.callbacks found; using the module-global hooks, which fire at the same points")
    wrap_training_module(training, hooks)
    training._mechmon_hooks = hooks
    return hooks


def _has_callback_api() -> bool:
    try:
        importlib.import_module("megatron.training.callbacks")
    except ImportError:
        return False
    return True
