"""``--mechmon-*`` command-line flags, shared by every host (Megatron-LM, the example trainer).

``add_mechmon_args`` follows Megatron-LM's ``extra_args_provider`` convention (takes a parser,
returns it) and can be chained with another provider via ``chain_providers``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable, Optional

from mechmon_megatron._version import __version__
from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.session.config import OPTIONS, MechmonConfig, argparse_kwargs, default_of, flag_of
from mechmon_megatron.session.host_settings import graphed_router
from mechmon_megatron.session.startup import RunFacts, log_startup_warnings, validate_startup

logger = logging.getLogger(__name__)

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


REMOVED_FLAGS = (
    "--mechmon-detector-warmup",
    "--mechmon-detector-window",
    "--mechmon-detector-num-mads",
    "--mechmon-detector-min-rel-change",
    "--mechmon-detector-patience",
)
"""Flags of the 0.1 per-stream detector; naming one is an error that says what replaced it."""


GIVEN_FLAGS = "mechmon_flags_given"
"""Namespace attribute: the ``--mechmon*`` flags the command line named, in order (set by the parser
itself, only when one was named; :func:`given_mechmon_flags` reads it)."""


def _record_given(namespace: argparse.Namespace, flag: str) -> None:
    given = tuple(getattr(namespace, GIVEN_FLAGS, ()))
    if flag not in given:
        setattr(namespace, GIVEN_FLAGS, (*given, flag))


class _Store(argparse._StoreAction):
    """``store``, and the flag is recorded as given (argparse calls an action only for a flag the
    command line names, in any spelling it accepts: ``--flag=v``, an abbreviation, ``@file``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _record_given(namespace, self.option_strings[0])


class _StoreTrue(argparse._StoreTrueAction):
    """``store_true``, and the flag is recorded as given (see :class:`_Store`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _record_given(namespace, self.option_strings[0])


def _dest(flag: str) -> str:
    """The namespace attribute argparse stores a flag in: ``--mechmon-log-dir`` -> ``mechmon_log_dir``."""
    return flag[2:].replace("-", "_")


def given_mechmon_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``--mechmon*`` flags the command line named (not the values that differ from their
    defaults: ``--mechmon-interval 100`` is given although 100 is the default), in the order named.

    Recorded by the parser that :func:`add_mechmon_args` extended, whatever host owns it (the
    example trainer, Megatron-LM under ``mechmon-run`` or the patched script), so no host has to
    hand its argv over. A namespace that no such parser made names none.
    """
    return tuple(getattr(args, GIVEN_FLAGS, ()))


def add_mechmon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--mechmon*`` flags (an argument group named ``mechmon``) and return the parser.

    One flag per :class:`MechmonConfig` field, generated from its metadata (:data:`OPTIONS`).
    Each flag the command line names is recorded in the namespace (:func:`given_mechmon_flags`):
    flags given without ``--mechmon`` are refused at start-up (:func:`startup_config`)."""
    g = parser.add_argument_group(title="mechmon", description="mechanism-driven training monitors")
    for name in OPTIONS:
        kwargs = argparse_kwargs(name)
        kwargs["action"] = _StoreTrue if kwargs.get("action") == "store_true" else _Store
        g.add_argument(flag_of(name), **kwargs)
    for flag in REMOVED_FLAGS:  # 0.1 flags: accepted by the parser so that the error can name them
        g.add_argument(flag, type=str, default=None, help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> MechmonConfig:
    """Build and validate the session config; ``ValueError`` names the offending flag."""
    for flag in REMOVED_FLAGS:
        if getattr(args, _dest(flag), None) is not None:
            raise ValueError(
                f"{flag} was removed in mechmon 0.2 (this is {__version__}): the detector sets its thresholds "
                f"from one number, {flag_of('false_alarm_rate')} (expected false alarms per 10^6 steps for the "
                "whole job)."
            )
    values: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        # A namespace made before a flag existed (e.g. saved with a checkpoint) has the flag's default.
        value = getattr(args, _dest(flag_of(name)), argparse_kwargs(name).get("default"))
        if option.kind == "bool":
            value = not value if option.negated else bool(value)
        elif option.host_default and value is None:
            value = _HOST_DEFAULTS[name](args)
        values[name] = value
    try:
        return MechmonConfig(**values)
    except ConfigError as exc:
        raise ValueError(exc.render(flag_of)) from None


def validate_mechmon_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> MechmonConfig:
    """Parse-time validation of the whole configuration (:func:`startup_config`): exits through
    ``parser.error`` (status 2, one line naming the bad flag or file); logs the start-up warnings."""
    try:
        return startup_config(args)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def startup_config(args: argparse.Namespace) -> MechmonConfig:
    """The config of ``args``, checked once with what the host's own flags say of the run
    (``session/startup.py``); ``ValueError`` names the flag. Warnings are logged on rank 0.

    ``--mechmon-*`` flags given without ``--mechmon`` are refused: whoever wrote them wants the
    run watched, and a disabled session would train it unwatched without a word; failing at
    start-up loses nothing."""
    unswitched = [] if getattr(args, "mechmon", False) else [f for f in given_mechmon_flags(args) if f != "--mechmon"]
    if unswitched:
        raise ValueError(f"{', '.join(unswitched)} given without --mechmon: add --mechmon to monitor, or drop "
                         f"{'them' if len(unswitched) > 1 else 'it'}")
    config = config_from_args(args)
    try:
        report = validate_startup(config, run_facts(args))
    except ConfigError as exc:
        raise ValueError(exc.render(flag_of)) from None
    # Once per job, not once per rank: no process group exists yet, the launcher's RANK says which.
    log_startup_warnings(report, int(os.environ.get("RANK", "0") or 0), spell=flag_of)
    return config


def run_facts(args: argparse.Namespace) -> RunFacts:
    """What a Megatron-style namespace (Megatron-LM, the example trainer) says of the run:
    ``--train-iters``, ``--num-layers``, ``--save``, the Q/K shape of one snapshot set and the
    routers' experts (``--num-experts``, ``--moe-router-topk``)."""
    layers = getattr(args, "num_layers", None)
    experts, topk = getattr(args, "num_experts", None), getattr(args, "moe_router_topk", None)
    return RunFacts(
        train_iters=getattr(args, "train_iters", None),
        num_layers=layers if isinstance(layers, int) and layers > 0 else None,
        snapshot_set_bytes=_snapshot_set_bytes(args),
        save_dir=getattr(args, "save", None),
        save_flag="--save",
        host_timeout_s=_host_timeout_s(args),
        host_timeout_flag="--distributed-timeout-minutes",
        graphed_router=graphed_router(args),
        router_experts=(experts, topk) if all(isinstance(v, int) and v > 0 for v in (experts, topk)) else None,
    )


def _collective_timeout(args: argparse.Namespace) -> float:
    """``--mechmon-collective-timeout``, or its default: 120 s, or a quarter of the host's own
    collective timeout when that is shorter (a monitor collective must give up first)."""
    value = getattr(args, "mechmon_collective_timeout", None)
    if value is not None:
        return value
    host = _host_timeout_s(args)
    default = default_of("collective_timeout")
    return min(default, host / 4) if host is not None else default


_HOST_DEFAULTS: dict[str, Callable[[argparse.Namespace], Any]] = {"collective_timeout": _collective_timeout}
"""Field -> its command-line default, from the host's own flags (``Option.host_default``)."""


def _host_timeout_s(args: argparse.Namespace) -> Optional[float]:
    minutes = getattr(args, "distributed_timeout_minutes", None)
    return 60.0 * minutes if isinstance(minutes, (int, float)) and minutes > 0 else None


def _snapshot_set_bytes(args: argparse.Namespace) -> Optional[int]:
    """FP32 W_q and W_k of every layer a rank holds (tensor and pipeline split): one snapshot set."""
    layers, hidden, heads = (getattr(args, k, None) for k in ("num_layers", "hidden_size", "num_attention_heads"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, hidden, heads)):
        return None
    assert isinstance(layers, int) and isinstance(hidden, int) and isinstance(heads, int)
    head_dim = getattr(args, "kv_channels", None) or hidden // heads
    groups = getattr(args, "num_query_groups", None) or heads
    split = (getattr(args, "tensor_model_parallel_size", None) or 1) * (getattr(args, "pipeline_model_parallel_size",
                                                                               None) or 1)
    return int(4 * layers * (heads + groups) * head_dim * hidden / max(1, split))


def chain_providers(*providers: Optional[ArgsProvider]) -> ArgsProvider:
    """One ``extra_args_provider`` that applies each non-None provider in order."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in providers:
            if p is not None:
                parser = p(parser) or parser
        return parser

    return provider
