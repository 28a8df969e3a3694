"""``mechmon_megatron.deepspeed.attach(engine)``: the DeepSpeed entry point (see docs/DEEPSPEED.md)."""

from mechmon_megatron.adapters.deepspeed import (  # noqa: F401
    CLIENT_ALERT_KEY,
    CLIENT_STATE_KEY,
    MechmonDeepSpeed,
    attach,
    config_from_ds_config,
    parse_section,
)

__all__ = ["attach", "MechmonDeepSpeed", "config_from_ds_config", "parse_section", "CLIENT_STATE_KEY", "CLIENT_ALERT_KEY"]
