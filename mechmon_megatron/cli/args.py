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
from mechmon_megatron.session.config import ACTIONS, MONITOR_FAMILIES, MechmonConfig
from mechmon_megatron.session.host_settings import graphed_router
from mechmon_megatron.session.startup import RunFacts, log_startup_warnings, validate_startup

logger = logging.getLogger(__name__)

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
_DEFAULTS = MechmonConfig()


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

    Each flag the command line names is recorded in the namespace (:func:`given_mechmon_flags`):
    flags given without ``--mechmon`` are refused at start-up (:func:`startup_config`)."""
    g = parser.add_argument_group(title="mechmon", description="mechanism-driven training monitors")

    def add(*names: str, **kwargs: Any) -> None:
        kwargs["action"] = _StoreTrue if kwargs.get("action") == "store_true" else _Store
        g.add_argument(*names, **kwargs)

    add("--mechmon", action="store_true", help="Enable the mechanism monitors.")
    add("--mechmon-interval", type=int, default=_DEFAULTS.interval, help="Check every N iterations.")
    add(
        "--mechmon-delta",
        type=int,
        default=_DEFAULTS.delta,
        help="Increment window (iterations): compare weights at t and t - delta.",
    )
    add(
        "--mechmon-monitors",
        type=str,
        default=",".join(_DEFAULTS.monitors),
        help=f"Comma-separated monitor families from {list(MONITOR_FAMILIES)}.",
    )
    add(
        "--mechmon-alpha",
        type=float,
        default=_DEFAULTS.alpha,
        help="Spectral-entropy exponent (2 = energy, 1 = Roy-Vetterli).",
    )
    add(
        "--mechmon-qk-method",
        type=str,
        default=_DEFAULTS.qk_method,
        help="Per-head kernel: gram (fast) or compressed (QR).",
    )
    add(
        "--mechmon-no-full-matrix-dw",
        action="store_true",
        help="Skip the full-matrix dW_q/dW_k spectra (saves a TP gather).",
    )
    add(
        "--mechmon-full-matrix-method",
        type=str,
        default=_DEFAULTS.full_matrix_method,
        help="Full-matrix dW spectrum: randomized (top-k with a certified bound) or exact (full SVD).",
    )
    add(
        "--mechmon-full-matrix-rank",
        type=int,
        default=_DEFAULTS.full_matrix_rank,
        help="Singular values kept by the randomized full-matrix spectrum.",
    )
    add(
        "--mechmon-wq-norm-power-iters",
        type=int,
        default=_DEFAULTS.wq_norm_power_iters,
        help="Power iterations for the W_q spectral norm (0: exact SVD).",
    )
    add("--mechmon-action", type=str, default=_DEFAULTS.action, help=f"On alarm: one of {list(ACTIONS)}.")
    add(
        "--mechmon-exit-code",
        type=int,
        default=_DEFAULTS.exit_code,
        help="Exit code after checkpoint-and-abort (not 0, 1, 16, 17).",
    )
    add(
        "--mechmon-snapshot-device",
        type=str,
        default=_DEFAULTS.snapshot_device,
        help="Where weight snapshots live: auto, device, cpu or pinned (page-locked host memory).",
    )
    add(
        "--mechmon-weights",
        type=str,
        default=_DEFAULTS.weights,
        help="Read the FP32 main parameters the optimizer updates (main) or the model weights (model).",
    )
    add(
        "--mechmon-snapshot-max-device-share",
        type=float,
        default=_DEFAULTS.snapshot_max_device_share,
        help="Under --mechmon-snapshot-device auto: the largest share of accelerator memory snapshots may take "
        "before they move to pinned host memory.",
    )
    add(
        "--mechmon-log-dir", type=str, default=None, help="Own TensorBoard + JSONL output when the host has no writer."
    )
    add(
        "--mechmon-drill-at",
        type=int,
        default=None,
        help="Raise a synthetic alarm at this iteration (rehearse the action).",
    )
    add(
        "--mechmon-strict", action="store_true", help="Let monitor exceptions stop training (default: log and count)."
    )
    add(
        "--mechmon-collective-timeout",
        type=float,
        default=None,
        help="Seconds a monitor collective waits for its peers before the monitors turn off on every rank "
        "(--mechmon-strict: every rank stops); default 120, or a quarter of --distributed-timeout-minutes "
        "when that is shorter; must stay below half of it.",
    )
    add("--mechmon-per-head-scalars", action="store_true", help="Also write one Delta2 scalar per head.")
    add(
        "--mechmon-router-entropy-bins",
        type=int,
        default=_DEFAULTS.router_entropy_bins,
        help="Histogram bins for the routing-entropy quantiles (error <= log E / bins).",
    )
    add(
        "--mechmon-router-min-effective-experts",
        type=str,
        default=str(_DEFAULTS.router_min_effective_experts),
        help="Routing-entropy floor as effective experts per token, exp(mean entropy): "
        "topk (default), a number >= 1, or off.",
    )
    add(
        "--mechmon-false-alarm-rate",
        type=float,
        default=_DEFAULTS.false_alarm_rate,
        help="Expected false alarms per 1,000,000 steps for the whole job (default 0.01); every detector "
        "threshold follows from it.",
    )
    add(
        "--mechmon-detector-calibration",
        type=str,
        default=None,
        help="Null-tail table of your own healthy runs (mechmon-calibrate); default: the shipped one.",
    )
    add(
        "--mechmon-alert-webhook",
        type=str,
        default=None,
        help="http(s) URL: each alarm is posted there as Slack-compatible JSON (writer rank, never blocks).",
    )
    add(
        "--mechmon-detector-shewhart",
        action="store_true",
        help="Also alarm at once on one check far beyond the null tail (Shewhart limit; off by default).",
    )
    add(
        "--mechmon-short-window",
        action="store_true",
        help="Also compute Delta2 over the last --mechmon-interval steps at every check (detector family "
        "attn_delta2_short; needs a calibration with that family; off by default).",
    )
    for flag in REMOVED_FLAGS:  # 0.1 flags: accepted by the parser so that the error can name them
        g.add_argument(flag, type=str, default=None, help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> MechmonConfig:
    """Build and validate the session config; ``ValueError`` names the offending flag."""
    for flag in REMOVED_FLAGS:
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            raise ValueError(
                f"{flag} was removed in mechmon 0.2 (this is {__version__}): the detector sets its thresholds "
                "from one number, --mechmon-false-alarm-rate (expected false alarms per 10^6 steps for the "
                "whole job)."
            )
    monitors = tuple(m.strip() for m in str(args.mechmon_monitors).split(",") if m.strip())
    return MechmonConfig(
        enabled=bool(args.mechmon),
        interval=args.mechmon_interval,
        delta=args.mechmon_delta,
        monitors=monitors,
        alpha=args.mechmon_alpha,
        qk_method=args.mechmon_qk_method,
        full_matrix_dw=not args.mechmon_no_full_matrix_dw,
        action=args.mechmon_action,
        exit_code=args.mechmon_exit_code,
        snapshot_device=args.mechmon_snapshot_device,
        snapshot_max_device_share=args.mechmon_snapshot_max_device_share,
        weights=args.mechmon_weights,
        full_matrix_method=args.mechmon_full_matrix_method,
        full_matrix_rank=args.mechmon_full_matrix_rank,
        wq_norm_power_iters=args.mechmon_wq_norm_power_iters,
        log_dir=args.mechmon_log_dir,
        drill_at=args.mechmon_drill_at,
        strict=bool(args.mechmon_strict),
        collective_timeout=_collective_timeout(args),
        per_head_scalars=bool(args.mechmon_per_head_scalars),
        router_entropy_bins=args.mechmon_router_entropy_bins,
        router_min_effective_experts=args.mechmon_router_min_effective_experts,
        false_alarm_rate=args.mechmon_false_alarm_rate,
        detector_calibration=args.mechmon_detector_calibration,
        alert_webhook=getattr(args, "mechmon_alert_webhook", None),
        detector_shewhart=bool(getattr(args, "mechmon_detector_shewhart", False)),
        short_window=bool(getattr(args, "mechmon_short_window", False)),
    )


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
    report = validate_startup(config, run_facts(args))
    # Once per job, not once per rank: no process group exists yet, the launcher's RANK says which.
    log_startup_warnings(report, int(os.environ.get("RANK", "0") or 0))
    return config


def run_facts(args: argparse.Namespace) -> RunFacts:
    """What a Megatron-style namespace (Megatron-LM, the example trainer) says of the run:
    ``--train-iters``, ``--num-layers``, ``--save`` and the Q/K shape of one snapshot set."""
    layers = getattr(args, "num_layers", None)
    return RunFacts(
        train_iters=getattr(args, "train_iters", None),
        num_layers=layers if isinstance(layers, int) and layers > 0 else None,
        snapshot_set_bytes=_snapshot_set_bytes(args),
        save_dir=getattr(args, "save", None),
        save_flag="--save",
        host_timeout_s=_host_timeout_s(args),
        host_timeout_flag="--distributed-timeout-minutes",
        graphed_router=graphed_router(args),
    )


def _collective_timeout(args: argparse.Namespace) -> float:
    """``--mechmon-collective-timeout``, or its default: 120 s, or a quarter of the host's own
    collective timeout when that is shorter (a monitor collective must give up first)."""
    value = getattr(args, "mechmon_collective_timeout", None)
    if value is not None:
        return value
    host = _host_timeout_s(args)
    return min(_DEFAULTS.collective_timeout, host / 4) if host is not None else _DEFAULTS.collective_timeout


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
