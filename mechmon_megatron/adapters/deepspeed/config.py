"""The ``"mechmon"`` section of a DeepSpeed JSON config -> :class:`MechmonConfig`.

Keys are the snake_case names of the ``--mechmon-*`` flags (the :class:`MechmonConfig` fields),
plus two DeepSpeed-only keys kept in ``MechmonConfig.extra``:

``checkpoint_dir``
    Where checkpoint-and-abort saves (default: the directory of the last
    ``engine.save_checkpoint`` call, else ``log_dir``).
``attention_mapping``
    A list of user-described attention layouts (see ``attention_layouts.MappingEntry``).

Example::

    "mechmon": {"enabled": true, "interval": 10, "delta": 10, "monitors": ["attn", "router"],
                "action": "checkpoint-and-abort", "exit_code": 42}

Every error names the key, e.g. ``ds_config.mechmon.interval must be >= 1, got 0``. A section
with keys must say ``"enabled"`` (true, or false to keep it without monitoring, which ``attach``
reports in one line); only an absent or empty section is silently disabled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping, Optional, Union

from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.startup import RunFacts, validate_startup

SECTION = "mechmon"
PREFIX = f"ds_config.{SECTION}"
EXTRA_KEYS = ("checkpoint_dir", "attention_mapping")
_FIELDS = {f.name: f for f in dataclasses.fields(MechmonConfig) if f.name != "extra"}
_INT_KEYS = ("interval", "delta", "exit_code", "drill_at", "router_entropy_bins", "full_matrix_rank",
             "wq_norm_power_iters")
_FLOAT_KEYS = ("alpha", "false_alarm_rate", "snapshot_max_device_share", "collective_timeout")
_BOOL_KEYS = ("enabled", "full_matrix_dw", "strict", "per_head_scalars", "detector_shewhart",
              "short_window")
_STR_KEYS = ("qk_method", "action", "snapshot_device", "log_dir", "detector_calibration", "full_matrix_method",
             "weights", "alert_webhook")
_OPTIONAL_STR_KEYS = ("log_dir", "alert_webhook")
"""String keys whose JSON null means "not set"."""


def read_ds_config(source: Union[str, os.PathLike, Mapping[str, Any]]) -> dict:
    """A DeepSpeed config as a dict: a dict is returned as is, a path is read as JSON."""
    if isinstance(source, Mapping):
        return dict(source)
    with open(source, encoding="utf-8") as f:
        return json.load(f)


def config_from_ds_config(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> MechmonConfig:
    """The validated mechmon config of a whole DeepSpeed config (disabled when the section is absent)."""
    section = read_ds_config(ds_config).get(SECTION)
    if section is None:
        return MechmonConfig(enabled=False)
    return parse_section(section)


def parse_section(section: Mapping[str, Any]) -> MechmonConfig:
    """Validate one ``"mechmon"`` section; ``ValueError`` names the offending key."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{PREFIX} must be a JSON object, got {type(section).__name__}")
    unknown = sorted(set(section) - set(_FIELDS) - set(EXTRA_KEYS))
    if unknown:
        known = sorted([*_FIELDS, *EXTRA_KEYS])
        raise ValueError(f"{PREFIX}: unknown key(s) {unknown}; known keys: {known}")
    kwargs: dict[str, Any] = {}
    for key, value in section.items():
        if key in EXTRA_KEYS:
            continue
        kwargs[key] = _typed(key, value)
    extra = {key: section[key] for key in EXTRA_KEYS if section.get(key) is not None}
    if "checkpoint_dir" in extra and not isinstance(extra["checkpoint_dir"], str):
        raise ValueError(f"{PREFIX}.checkpoint_dir must be a string path, got {extra['checkpoint_dir']!r}")
    if "attention_mapping" in extra:
        from mechmon_megatron.adapters.deepspeed.attention_layouts import parse_mapping

        extra["attention_mapping"] = parse_mapping(extra["attention_mapping"], f"{PREFIX}.attention_mapping")
    try:
        config = MechmonConfig(**kwargs, extra=extra)
    except ValueError as exc:  # MechmonConfig names the flag; name the JSON key instead
        raise ValueError(as_key_message(str(exc))) from None
    if section and "enabled" not in section:
        # Keys say the user wants the run watched; a disabled default would train it unwatched
        # without a word. An empty section asks for nothing (as if absent).
        raise ValueError(f"{PREFIX}.enabled is not set, but the section sets {sorted(section)}: add \"enabled\": true "
                         f"to monitor, or \"enabled\": false to keep the section without monitoring")
    try:  # the start-up check every host runs (session/startup.py), in this config's key names
        validate_startup(config, RunFacts(save_dir=extra.get("checkpoint_dir") or config.log_dir,
                                          save_flag=f"{PREFIX}.checkpoint_dir (or {PREFIX}.log_dir)"))
    except ValueError as exc:
        raise ValueError(as_key_message(str(exc))) from None
    if config.weights != "main":
        raise ValueError(f"{PREFIX}.weights: the DeepSpeed adapter reads the FP32 master weights the optimizer "
                         f"updates (safe_get_full_fp32_param); \"model\" is not supported, got {config.weights!r}")
    return config


def _typed(key: str, value: Any) -> Any:
    where = f"{PREFIX}.{key}"
    if key in _INT_KEYS:
        if value is None and key == "drill_at":
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return value
    if key in _FLOAT_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if key in _STR_KEYS:
        if value is None and key == "log_dir":
            return None
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    if key == "router_min_effective_experts":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{where} must be \"topk\", \"off\" or a number, got {value!r}")
        return value
    if key == "monitors":
        if isinstance(value, str):
            value = [m.strip() for m in value.split(",") if m.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) for m in value):
            raise ValueError(f"{where} must be a list of family names (e.g. [\"attn\", \"router\"]), got {value!r}")
        return tuple(value)
    raise AssertionError(f"no type rule for {key}")  # every field has one (tests pin this)


def as_key_message(message: str) -> str:
    """``--mechmon-exit-code must ...`` -> ``ds_config.mechmon.exit_code must ...``."""
    message = re.sub(r"--mechmon-([a-z0-9-]+)", lambda m: f"{PREFIX}.{m.group(1).replace('-', '_')}", message)
    return message if message.startswith(PREFIX) else f"{PREFIX}: {message}"


def checkpoint_dir_of(config: MechmonConfig) -> Optional[str]:
    return config.extra.get("checkpoint_dir")
