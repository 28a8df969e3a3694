"""Alias kept for the Megatron-LM patch: ``from mechmon_megatron import megatron_lm as mechmon``.

The patches in ``patches/megatron-lm/`` (and hand-edited ``pretrain_gpt.py`` files) import this
name; the adapter itself lives in :mod:`mechmon_megatron.adapters.megatron_lm`.
"""

from mechmon_megatron.adapters.megatron_lm import add_arguments, extra_args_provider, install

__all__ = ["add_arguments", "extra_args_provider", "install"]
