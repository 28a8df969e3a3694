"""Megatron-LM adapter: the monitors inside Megatron-LM's own ``pretrain_gpt.py``.

``mechmon-run pretrain_gpt.py ARGS`` (:mod:`.run`) attaches the monitoring session to an
unmodified Megatron-LM training loop from outside; or two calls in ``pretrain_gpt.py`` (written
by ``mechmon-patch``, see ``patches/README.md``) do::

    from mechmon_megatron import megatron_lm as mechmon
    mechmon.install()
    pretrain(..., extra_args_provider=mechmon.extra_args_provider(existing_provider))

Files, one job each: ``flags`` (the ``--mechmon*`` flags as an ``extra_args_provider``),
``hooks`` (:class:`MegatronLMHooks`: build the session, run checks, save-and-exit, mechmon's
state in Megatron's own torch_dist checkpoint, or beside a ``torch`` one), ``install`` (wrap
``megatron.training.training`` and ``megatron.training.checkpointing``), ``run``
(``mechmon-run``: hooks, flags and parse-time validation, then the unmodified script),
``anchors`` (the three insertion points of ``pretrain_gpt.py``, located by content),
``patch_tool`` (``mechmon-patch``: apply / status / revert).

Scalars go to Megatron's own TensorBoard (``get_tensorboard_writer()``, last rank) and W&B
(``get_wandb_writer()``) writers when they exist, else to ``--mechmon-log-dir``. Flags, scalar
names and the session are those of megatron-core loops (:mod:`..megatron_core`), whose public
entry point this adapter builds on: Megatron-LM trains megatron-core models.
"""

from typing import Any

from mechmon_megatron.adapters.megatron_lm.flags import add_arguments, extra_args_provider
from mechmon_megatron.adapters.megatron_lm.install import (
    install,
    unwrap_training_module,
    wrap_checkpointing_module,
    wrap_training_module,
)

_HOOKS_EXPORTS = ("STATE_DIR", "STATE_FILENAME", "MegatronLMHooks", "checkpoint_iter_dir", "state_path")

__all__ = [
    "STATE_DIR",
    "STATE_FILENAME",
    "MegatronLMHooks",
    "add_arguments",
    "checkpoint_iter_dir",
    "extra_args_provider",
    "install",
    "state_path",
    "unwrap_training_module",
    "wrap_checkpointing_module",
    "wrap_training_module",
]


def __getattr__(name: str) -> Any:
    """The hooks (torch, megatron-core) load on first use (PEP 562): ``mechmon-patch`` imports
    ``.patch_tool`` through this package and should not pay for torch."""
    if name not in _HOOKS_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from mechmon_megatron.adapters.megatron_lm import hooks

    return getattr(hooks, name)
