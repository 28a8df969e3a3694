"""The ``"mechmon"`` section of a DeepSpeed JSON config -> :class:`MechmonConfig`.

Keys are the :class:`MechmonConfig` field names (the snake_case names of the ``--mechmon-*``
flags), plus two DeepSpeed-only keys kept in ``MechmonConfig.extra``:

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

import json
import os
from typing import Any, Mapping, Optional, Union

from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.session.config import OPTIONS, MechmonConfig
from mechmon_megatron.session.startup import RunFacts, StartupReport, validate_startup

SECTION = "mechmon"
PREFIX = f"ds_config.{SECTION}"
EXTRA_KEYS = ("checkpoint_dir", "attention_mapping")


def key_of(name: str) -> str:
    """How this front end spells a setting: ``interval`` -> ``ds_config.mechmon.interval``."""
    return f"{PREFIX}.{name}"


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
    """Validate one ``"mechmon"`` section; ``ValueError`` names the offending key.

    The keys are the :class:`MechmonConfig` fields, their JSON values taken as they are: the
    fields' metadata (``session/options.py``) says which types each takes (a number for a float,
    a list or a comma string for ``monitors``, null for "not set" where a field is optional)."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{PREFIX} must be a JSON object, got {type(section).__name__}")
    unknown = sorted(set(section) - set(OPTIONS) - set(EXTRA_KEYS))
    if unknown:
        known = sorted([*OPTIONS, *EXTRA_KEYS])
        raise ValueError(f"{PREFIX}: unknown key(s) {unknown}; known keys: {known}")
    settings = {key: value for key, value in section.items() if key not in EXTRA_KEYS}
    extra = {key: section[key] for key in EXTRA_KEYS if section.get(key) is not None}
    if "checkpoint_dir" in extra and not isinstance(extra["checkpoint_dir"], str):
        raise ValueError(f"{PREFIX}.checkpoint_dir must be a string path, got {extra['checkpoint_dir']!r}")
    if "attention_mapping" in extra:
        from mechmon_megatron.adapters.deepspeed.attention_layouts import parse_mapping

        extra["attention_mapping"] = parse_mapping(extra["attention_mapping"], f"{PREFIX}.attention_mapping")
    try:
        config = MechmonConfig(**settings, extra=extra)
    except ConfigError as exc:
        raise ValueError(exc.render(key_of)) from None
    if section and "enabled" not in section:
        # Keys say the user wants the run watched; a disabled default would train it unwatched
        # without a word. An empty section asks for nothing (as if absent).
        raise ValueError(f"{PREFIX}.enabled is not set, but the section sets {sorted(section)}: add \"enabled\": true "
                         f"to monitor, or \"enabled\": false to keep the section without monitoring")
    checked_startup(config, RunFacts(save_dir=extra.get("checkpoint_dir") or config.log_dir,
                                     save_flag=f"{PREFIX}.checkpoint_dir (or {PREFIX}.log_dir)"))
    if config.weights != "main":
        raise ValueError(f"{PREFIX}.weights: the DeepSpeed adapter reads the FP32 master weights the optimizer "
                         f"updates (safe_get_full_fp32_param); \"model\" is not supported, got {config.weights!r}")
    return config


def checked_startup(config: MechmonConfig, facts: RunFacts) -> StartupReport:
    """The start-up check every host runs (``session/startup.py``), its errors naming the keys
    (``ValueError``); the report's warnings are logged with :func:`key_of` too."""
    try:
        return validate_startup(config, facts)
    except ConfigError as exc:
        raise ValueError(exc.render(key_of)) from None


def checkpoint_dir_of(config: MechmonConfig) -> Optional[str]:
    return config.extra.get("checkpoint_dir")
