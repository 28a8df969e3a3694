"""DeepSpeed adapter: the mechmon monitors on a DeepSpeed engine with one call.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=..., config="ds_config.json")
    mechmon = mechmon_megatron.deepspeed.attach(engine)   # reads the "mechmon" section of the config

Then train as usual (``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``,
``engine.save_checkpoint(...)``, ``engine.load_checkpoint(...)``): checks run after applied
steps, scalars go to ``engine.monitor`` under ``mechmon/``, detector state rides in the
checkpoint's ``client_state``. See docs/DEEPSPEED.md.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Union

from mechmon_megatron.adapters.deepspeed.config import (
    PREFIX,
    SECTION,
    config_from_ds_config,
    parse_section,
    read_ds_config,
)
from mechmon_megatron.adapters.deepspeed.engine_hooks import CLIENT_ALERT_KEY, CLIENT_STATE_KEY, MechmonDeepSpeed
from mechmon_megatron.detect.phase_moments import TrainingSchedule
from mechmon_megatron.session import collective_guard
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.log import mechmon_log

__all__ = [
    "attach",
    "MechmonDeepSpeed",
    "config_from_ds_config",
    "parse_section",
    "CLIENT_STATE_KEY",
    "CLIENT_ALERT_KEY",
    "TrainingSchedule",
]

log = mechmon_log(__name__)


def _engine_ds_config(engine: Any) -> dict:
    """The DeepSpeed config the engine was built from, as a dict."""
    raw = getattr(engine, "config", None)
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, (str, os.PathLike)) and os.path.exists(raw):
        return read_ds_config(raw)
    param_dict = getattr(getattr(engine, "_config", None), "_param_dict", None)  # DeepSpeedConfig's parsed dict
    return dict(param_dict or {})


def attach(
    engine: Any,
    config: Union[None, MechmonConfig, Mapping[str, Any], str, os.PathLike] = None,
    checkpoint_dir: Optional[str] = None,
    client_state_fn: Optional[Callable[[], Mapping[str, Any]]] = None,
    lr_schedule: Optional[TrainingSchedule] = None,
) -> MechmonDeepSpeed:
    """Attach the monitors to ``engine`` on every rank (after ``deepspeed.initialize``).

    ``config``: None (read the ``"mechmon"`` section of the engine's own DeepSpeed config), a
    :class:`MechmonConfig`, a ``"mechmon"`` section dict, or a whole DeepSpeed config (dict or
    JSON path) holding one. ``checkpoint_dir`` overrides ``mechmon.checkpoint_dir`` for
    checkpoint-and-abort. ``client_state_fn``: returns the training loop's own ``client_state``
    (sampler position, counters) at the moment it is called; the abort checkpoint of
    checkpoint-and-abort holds it beside mechmon's keys, so a resume from that checkpoint
    restores it. It is called once here to check it (a mapping with none of mechmon's keys
    ``"mechmon"`` / ``"mechmon_alert"``). The abort folder is checked here too. Bad input raises
    ``ValueError`` naming the key. A disabled config returns an object that does nothing (a
    section written with ``"enabled": false`` says so in one line on rank 0). ``lr_schedule``:
    the training loop's learning-rate warm-up, decay and peak learning rate (DeepSpeed cannot
    say what a user's scheduler does), which the early-phase correction compares with its
    calibration's; None, or no peak learning rate: the correction is off, and the writer says so
    in one line.
    """
    section: Any = None  # the "mechmon" section as written, when attach reads one
    if config is None or isinstance(config, (str, os.PathLike)):
        whole = _engine_ds_config(engine) if config is None else read_ds_config(config)
        section = whole.get(SECTION)
        config = config_from_ds_config(whole)
    elif isinstance(config, Mapping):
        section = config.get(SECTION) if SECTION in config else config
        config = config_from_ds_config(config) if SECTION in config else parse_section(config)
    if not isinstance(config, MechmonConfig):
        raise TypeError(f"attach(config=...) takes a MechmonConfig, a dict or a JSON path, got {type(config).__name__}")
    if isinstance(section, Mapping) and section.get("enabled") is False:
        # Written on purpose, but a job that trains unwatched says so once (parse_section refuses
        # a section with keys and no "enabled").
        log.warning("%s is present with enabled: false: not monitoring", PREFIX, rank=0)
    # The one place the DeepSpeed host looks up this process's collective guard: the communicator,
    # the readers and every session of the engine receive it.
    return MechmonDeepSpeed(engine, config, checkpoint_dir=checkpoint_dir, client_state_fn=client_state_fn,
                            guard=collective_guard.guard(), lr_schedule=lr_schedule)
