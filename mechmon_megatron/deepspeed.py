"""Alias kept for users: ``mechmon_megatron.deepspeed.attach(engine)`` (see docs/DEEPSPEED.md).

The adapter itself lives in :mod:`mechmon_megatron.adapters.deepspeed`.
"""

from mechmon_megatron.adapters.deepspeed import (
    CLIENT_ALERT_KEY,
    CLIENT_STATE_KEY,
    MechmonDeepSpeed,
    attach,
    config_from_ds_config,
    parse_section,
)

__all__ = [
    "attach",
    "MechmonDeepSpeed",
    "config_from_ds_config",
    "parse_section",
    "CLIENT_STATE_KEY",
    "CLIENT_ALERT_KEY",
]
