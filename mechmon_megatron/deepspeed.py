"""Alias kept for users: ``mechmon_megatron.deepspeed.attach(engine)`` (see docs/DEEPSPEED.md).

The adapter itself lives in :mod:`mechmon_megatron.adapters.deepspeed`; this module re-exports
its public names (``__all__`` is the adapter's, so the two cannot drift apart).
"""

from mechmon_megatron.adapters import deepspeed as _adapter
from mechmon_megatron.adapters.deepspeed import *  # noqa: F403 -- the alias is the adapter's public API

__all__ = list(_adapter.__all__)
