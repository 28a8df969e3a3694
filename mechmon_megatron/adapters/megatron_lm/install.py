"""``install()``: wrap four globals of ``megatron.training.training`` and two of
``megatron.training.checkpointing`` with the mechmon hooks.

``pretrain`` / ``train`` look these names up at call time (present in Megatron-LM core_v0.16.x
and current main):

* ``train_step``: builds the session on the first call and arms router-logit capture before the
  forward of a check step (``session.on_step_start``); capture stops when the step returns, so
  evaluation forwards are never counted.
* ``post_training_step_callbacks``: after the optimizer step and ``iteration += 1``, on every
  rank, before ``checkpoint_and_decide_exit`` of the same iteration. Forces the parameter
  all-gather (``--use-distributed-optimizer --overlap-param-gather``) on steps that read weights,
  then runs ``session.on_step_end``. An agreed abort sets ``args.exit_interval = iteration`` on
  every rank, so Megatron's own ``checkpoint_and_decide_exit`` saves a checkpoint at this
  iteration (when ``--save`` is set) and leaves the loop.
* ``save_checkpoint``: after each persistent save, the checkpoint is recorded (the alert's "last
  checkpoint before the first warning"); with ``--ckpt-format torch`` every rank's state is
  written beside it (``mechmon_state/rank_RRRRR.json``).

and two of ``megatron.training.checkpointing`` (present in core_v0.16.x to core_v0.19.x and main):

* ``generate_state_dict``: the state dict a save writes gains this rank's ``ShardedObject`` under
  ``mechmon`` (``--ckpt-format torch_dist``), so Megatron's own distributed checkpoint holds
  mechmon's state, sharded per rank. Its load template (``optim_sd_kwargs["is_loading"]``) is left
  as it is.
* ``_load_global_dist_base_checkpoint``: the load of a torch_dist checkpoint; when the checkpoint
  holds the ``mechmon`` entry, the template names this rank's shard and the loaded state is kept
  for the session (built at the first training step). A checkpoint without it loads unchanged.
* argument parsing (``megatron.training.arguments.parse_args`` / ``parse_and_validate_args``, see
  :mod:`.run`): the ``--mechmon*`` flags are added once and validated when parsed, before any
  process group or model exists (exit status 2 naming the flag).
* ``train``: Megatron ends an early exit with ``sys.exit(0)`` after the loop (async saves
  finalized first). When the exit was ours, the wrapper writes ``mechmon_alert.json`` beside the
  abort checkpoint, waits for the writer rank (barrier), and exits with ``--mechmon-exit-code``
  instead. Other exits (signal handler, ``--exit-interval``, rerun machine) pass through unchanged.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the hooks (torch, megatron-core) load in install(): mechmon-patch stays light
    from mechmon_megatron.adapters.megatron_lm.hooks import MegatronLMHooks

from mechmon_megatron.adapters.megatron_lm.lr_override import retarget_param_groups
from mechmon_megatron.session.log import mechmon_log
from mechmon_megatron.session.state_format import STATE_KEY

log = mechmon_log(__name__)

TRAINING_MODULE = "megatron.training.training"
HOOKED = ("train_step", "post_training_step_callbacks", "save_checkpoint", "train")
_WRAPPED_MARK = "_mechmon_wrapped"
CHECKPOINTING_MODULE = "megatron.training.checkpointing"
CHECKPOINT_HOOKED = ("generate_state_dict", "_load_global_dist_base_checkpoint")


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


def _originals(module: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The functions ``names`` of ``module`` before wrapping; a clear error naming those missing."""
    missing = [name for name in names if not callable(getattr(module, name, None))]
    if missing:
        raise RuntimeError(
            f"mechmon: {module.__name__} has no {missing}; this Megatron-LM release is not supported by "
            "mechmon_megatron.megatron_lm.install() (known: core_v0.16.x to core_v0.19.x and main) -- please "
            "report it with your Megatron-LM commit"
        )
    return {name: getattr(module, name) for name in names}


def _install(module: Any, original: dict[str, Any], wrappers: dict[str, Any]) -> None:
    """Put ``wrappers`` in place of ``module``'s functions, each marked with its original (for unwrapping)."""
    for name, fn in wrappers.items():
        setattr(fn, _WRAPPED_MARK, original[name])
        setattr(module, name, fn)


def wrap_training_module(training: Any, hooks: MegatronLMHooks) -> None:
    """Replace the four hooked globals of ``training`` with wrappers calling ``hooks``."""
    original = _originals(training, HOOKED)

    @functools.wraps(original["train_step"])
    def train_step(*args, **kwargs):
        # train_step(forward_step_func, data_iterator, model, optimizer, ..., iteration=None)
        if hooks.optimizer is None:
            hooks.optimizer = kwargs.get("optimizer", args[3] if len(args) > 3 else None)
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
            log.warning(
                "checkpoint-and-abort at iteration %d: exiting with code %d",
                hooks.abort_iteration,
                hooks.exit_code,
            )
            raise SystemExit(hooks.exit_code) from None
        hooks.close()
        return result

    _install(training, original, {"train_step": train_step, "post_training_step_callbacks":
                                  post_training_step_callbacks, "save_checkpoint": save_checkpoint, "train": train})


def _is_loading(kwargs: dict) -> bool:
    """``generate_state_dict`` builds a load template (every release passes ``is_loading=True``
    in ``optim_sd_kwargs`` then), not the state dict of a save."""
    return bool((kwargs.get("optim_sd_kwargs") or {}).get("is_loading", False))


def wrap_checkpointing_module(checkpointing: Any, hooks: MegatronLMHooks) -> None:
    """Replace the two hooked globals of ``checkpointing`` (mechmon's entry in torch_dist checkpoints)."""
    original = _originals(checkpointing, CHECKPOINT_HOOKED)

    @functools.wraps(original["generate_state_dict"])
    def generate_state_dict(args, *rest, **kwargs):
        state_dict = original["generate_state_dict"](args, *rest, **kwargs)
        if not _is_loading(kwargs) and isinstance(state_dict, dict):
            entry = hooks.sharded_entry(args)
            if entry is not None:
                state_dict[STATE_KEY] = entry
        return state_dict

    @functools.wraps(original["_load_global_dist_base_checkpoint"])
    def load_global_dist_base_checkpoint(load_dir, args, rank0, sharded_state_dict, iteration, release, *rest,
                                         **kwargs):
        # the directory the original reads (rank0 reads the common state only: no template)
        from mechmon_megatron.adapters.megatron_lm.hooks import checkpoint_iter_dir

        checkpoint_dir = checkpoint_iter_dir(load_dir, iteration, release, checkpointing)
        added = not rank0 and hooks.add_load_entry(args, sharded_state_dict, checkpoint_dir)
        result = original["_load_global_dist_base_checkpoint"](load_dir, args, rank0, sharded_state_dict,
                                                               iteration, release, *rest, **kwargs)
        if added:
            hooks.take_loaded(result[0], checkpoint_dir)
        if not rank0 and getattr(args, "override_opt_param_scheduler", False) and isinstance(result[0], dict):
            changed = retarget_param_groups(result[0].get("optimizer"), args)
            if changed:
                log.info("--override-opt_param-scheduler: %d optimizer param group(s) of %s take max_lr / min_lr "
                         "from --lr %s --min-lr %s, not from the checkpoint", changed, checkpoint_dir,
                         getattr(args, "lr", None), getattr(args, "min_lr", None), rank=0)
        return result

    _install(checkpointing, original, {"generate_state_dict": generate_state_dict,
                                       "_load_global_dist_base_checkpoint": load_global_dist_base_checkpoint})


def unwrap_training_module(training: Any, checkpointing: Any = None) -> None:
    """Undo :func:`wrap_training_module` (and :func:`wrap_checkpointing_module` of ``checkpointing``)."""
    for module, names in ((training, HOOKED), (checkpointing, CHECKPOINT_HOOKED)):
        for name in names if module is not None else ():
            fn = getattr(module, name, None)
            inner = getattr(fn, _WRAPPED_MARK, None)
            if inner is not None:
                setattr(module, name, inner)


def install(training_module: Any = None, checkpointing_module: Any = None) -> MegatronLMHooks:
    """Attach mechmon to Megatron-LM's training loop; call once, before ``pretrain``.

    Nothing is built until the first training step, and a run without ``--mechmon`` only pays
    for four pass-through wrappers. Idempotent: a second call returns the installed hooks.
    (CPU runs of Megatron-LM, for tests and laptops, start through
    ``python -m mechmon_megatron.testing.megatron_lm_cpu pretrain_gpt.py ...``, which makes
    Megatron-LM run on CPU before this is called; the product itself never does.)
    """
    training = training_module or importlib.import_module(TRAINING_MODULE)
    try:
        checkpointing = checkpointing_module or importlib.import_module(CHECKPOINTING_MODULE)
    except ImportError as exc:
        raise RuntimeError(f"mechmon: cannot import {CHECKPOINTING_MODULE} ({exc}); this Megatron-LM release is not "
                           "supported by mechmon_megatron.megatron_lm.install()") from exc
    installed = getattr(training, "_mechmon_hooks", None)
    if installed is not None:
        return installed
    from megatron.training import get_args, global_vars

    from mechmon_megatron.adapters.megatron_lm.hooks import MegatronLMHooks

    hooks = MegatronLMHooks(
        get_args=get_args,
        get_tensorboard_writer=global_vars.get_tensorboard_writer,
        get_wandb_writer=getattr(global_vars, "get_wandb_writer", lambda: None),
    )
    if _has_callback_api():
        log.info(
            "megatron.training.callbacks found; using the module-global hooks, which fire at the same points"
        )
    wrap_checkpointing_module(checkpointing, hooks)  # first: a missing function leaves nothing wrapped
    wrap_training_module(training, hooks)
    training._mechmon_hooks = hooks
    if training_module is None:
        _validate_flags_at_parse()
    return hooks


def _validate_flags_at_parse() -> None:
    """Check the ``--mechmon*`` flags when Megatron parses its arguments (a patched script calls
    ``install()`` before its parsing call), as ``mechmon-run`` does (:mod:`.run`); where that is
    not possible they are checked when the session is built, at the first training step."""
    try:
        arguments = importlib.import_module("megatron.training.arguments")
    except ImportError:
        return
    from mechmon_megatron.adapters.megatron_lm import run

    try:
        run.wrap_argument_parsing(arguments)
    except run.LaunchError as exc:
        log.warning("%s; the --mechmon flags are checked at the first training step instead", exc)


def _has_callback_api() -> bool:
    try:
        importlib.import_module("megatron.training.callbacks")
    except ImportError:
        return False
    return True
