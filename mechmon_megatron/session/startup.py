"""One start-up validation of the whole configuration, shared by every host.

Every host (the example trainer, ``mechmon-run`` and the patched Megatron-LM script, the
DeepSpeed ``attach``, ``mechmon-scan``) calls :func:`validate_startup` once, when its arguments
are parsed and before any process group or model exists. Every value that a check uses later is
checked here, so that no check can fail at every step with a cause the user could have been told
about at once (the monitors would then be off while the job looks watched):

* the flags themselves (``MechmonConfig.__post_init__``: types, ranges, finite numbers);
* the calibration file (``--mechmon-detector-calibration``: JSON, schema, finite positive
  ``theta``, known overlaps, families and levels; a tail for every family at this overlap);
* derived quantities: the per-test false-alarm probability ``R / (N C)`` of the job's tests must
  lie in (0, 1) and below every family's measured ``P0(S > u0)``: then the thresholds follow
  (:func:`check_detector` says why without computing them);
* combinations: ``checkpoint-and-abort`` needs a save folder the host will write; the router
  monitors refuse a CUDA-graphed router (``session/host_settings.py``) and a routing-entropy
  floor above the router's experts (when the host knows them);
  ``--mechmon-log-dir`` must be (or become) a writable folder; ``--mechmon-collective-timeout``
  below half of the host's own collective timeout;
* the schedule against the run: a check interval, window or drill step that never happens
  within ``--train-iters`` is a warning saying nothing will be checked; more than
  :data:`QUIET_SNAPSHOT_SETS` snapshot sets held at once is a warning with their memory.

Errors are :class:`~mechmon_megatron.detect.config_error.ConfigError` naming the setting by its
field; the host renders it in one line with its own spelling (``--mechmon-interval``,
``ds_config.mechmon.interval``) and turns it into exit status 2 without a traceback. Warnings are
returned as :class:`~mechmon_megatron.detect.config_error.ConfigNote` for the host to log once, on
rank 0, in the same spelling, through :func:`log_startup_warnings`; when the session is built,
every host says what it watches through :func:`log_monitoring`, so a job prints the same start-up
lines on every host.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from mechmon_megatron.detect.config_error import ConfigError, ConfigNote, Spelling, literal
from mechmon_megatron.detect.families import ATTN_DELTA2, FAMILIES
from mechmon_megatron.detect.null_model import TAIL_LEVELS, JobShape, per_test_probability
from mechmon_megatron.session.config import MechmonConfig, flag_of
from mechmon_megatron.session.detector_setup import detector_families, load_detector_design, switched_on
from mechmon_megatron.session.log import mechmon_log

__all__ = [
    "QUIET_SNAPSHOT_SETS",
    "RunFacts",
    "StartupReport",
    "check_detector",
    "directory_problem",
    "graphed_router_error",
    "graphed_router_message",
    "job_layers",
    "log_left_out",
    "log_monitoring",
    "log_startup_warnings",
    "validate_startup",
]

log = mechmon_log(__name__)

QUIET_SNAPSHOT_SETS = 4
"""Snapshot sets (``ceil(delta / interval)``) held at once without a start-up warning."""

MIB = 1024 * 1024


@dataclass(kw_only=True, frozen=True)
class RunFacts:
    """What the host knows of the run before it builds anything (None: not known)."""

    train_iters: Optional[int] = None
    """Training steps of the run (``--train-iters``)."""

    num_layers: Optional[int] = None
    """Transformer layers with self-attention, whole model (``--num-layers``); counts the tests."""

    snapshot_set_bytes: Optional[int] = None
    """Bytes of one snapshot set of the Q/K weights on one rank (an estimate from the model shape)."""

    save_dir: Optional[str] = None
    """The folder the host writes the checkpoint of a checkpoint-and-abort to."""

    save_flag: Optional[str] = None
    """The host's flag (or config key) that sets ``save_dir``; None: the host needs no folder."""

    host_timeout_s: Optional[float] = None
    """The host's own collective timeout in seconds (Megatron's ``--distributed-timeout-minutes``)."""

    host_timeout_flag: str = "--distributed-timeout-minutes"
    """The host's flag (or config key) that sets ``host_timeout_s``."""
    graphed_router: Optional[str] = None
    """The host flags that put the MoE router in a CUDA graph (``host_settings.graphed_router``)."""

    router_experts: Optional[tuple[int, int]] = None
    """Experts per MoE router and the router's top-k (``--num-experts``, ``--moe-router-topk``)."""


@dataclass
class StartupReport:
    """What :func:`validate_startup` found: the warnings to log once (nothing wrong otherwise)."""

    warnings: list[ConfigNote] = field(default_factory=list)


def directory_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be (or become) a folder this process writes in; None when it can.

    Probes with a temporary folder in ``path`` or its nearest existing parent, removed at once:
    nothing is left behind, also when the answer is no.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a directory"
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"cannot be created: {probe} is not a directory"
    try:
        made = tempfile.mkdtemp(dir=probe, prefix=".mechmon-probe-")
    except OSError as exc:
        return f"cannot be written: {exc.strerror or exc} in {probe}"
    os.rmdir(made)
    return None


def validate_startup(config: MechmonConfig, facts: RunFacts = RunFacts()) -> StartupReport:
    """The one start-up check of the job (the single-field checks ran when ``config`` was made):
    everything the session will use later, with what the host knows of the run; ``ConfigError``
    naming the setting.

    A disabled config is not checked further: it builds nothing.
    """
    report = StartupReport()
    if not config.enabled:
        return report
    check_detector(config, job_layers(config, facts.num_layers))
    if config.log_dir is not None:
        problem = directory_problem(config.log_dir)
        if problem:
            raise ConfigError("log_dir", f"{literal(repr(config.log_dir))} {literal(problem)}")
    if config.action == "checkpoint-and-abort" and facts.save_flag is not None:
        _check_save_dir(config, facts)
    _check_collective_timeout(config, facts)
    if "router" in config.monitors and facts.graphed_router:
        raise graphed_router_error(facts.graphed_router)
    if "router" in config.monitors and facts.router_experts is not None:
        config.router_entropy_floor(*facts.router_experts)  # the session checks it again on each router
    report.warnings += _schedule_warnings(config, facts)
    return report


def log_startup_warnings(report: StartupReport, rank: int, spell: Spelling = flag_of) -> None:
    """Rank 0: one ``[mechmon]`` warning line per finding of :func:`validate_startup`, the same
    lines on every host, each setting named in the host's ``spell`` (e.g. DeepSpeed's JSON keys)."""
    if rank != 0:
        return
    for note in report.warnings:
        log.warning("%s", note.render(spell))


def log_monitoring(config: MechmonConfig, attention_layers: int, routers: int, rank: int,
                   attention_kind: str = "self-attention", router_kind: str = "MoE router") -> None:
    """Rank 0, once the session is built: what it watches (layers, routers, schedule, action),
    and a notice for each monitor family that found nothing to watch on this rank. Every host
    calls this one function, so the start-up lines read the same whatever the host.

    ``attention_kind`` / ``router_kind``: what the host looked for (its module names), for the
    notices."""
    if rank != 0:
        return
    if "attn" in config.monitors and not attention_layers:
        log.warning("no %s found on rank 0: attention monitors idle there", attention_kind)
    if "router" in config.monitors and not routers:
        log.warning("no %s found on rank 0: router monitors idle (dense model?)", router_kind)
    log.info("monitoring %d attention layers and %d routers on rank 0 (interval %d, delta %d, "
             "action %s)", attention_layers, routers, config.interval, config.delta, config.action)


def log_left_out(left_out: Sequence[Any]) -> None:
    """One start-up line naming every sequence-mixing layer the attention monitors leave out and
    why (items with ``layer_number``, ``name``, ``reason``): those layers are not in the union
    bound, and nothing is written for them."""
    if not left_out:
        return
    by_reason: dict[str, list[str]] = {}
    for item in left_out:
        where = item.name if item.layer_number is None else f"layer {item.layer_number}"
        by_reason.setdefault(item.reason, []).append(where)
    log.warning("attention monitors leave out %d layer(s): %s", len(left_out),
                "; ".join(f"{', '.join(layers)}: {reason}" for reason, layers in by_reason.items()))


def graphed_router_error(setting: str) -> ConfigError:
    """The refusal of a CUDA-graphed router (``setting``: the host flags that graph it)."""
    return ConfigError("monitors", f"router cannot watch a CUDA-graphed MoE router ({literal(setting)}): a graph "
                       "replay skips the capture in Python, so the router statistics would be missing; leave router "
                       "out of $monitors (e.g. $monitors attn) or keep the router out of the graph "
                       "(--cuda-graph-scope attn)")


def graphed_router_message(setting: str) -> str:
    """:func:`graphed_router_error` in the command line's spelling (the model's own config, Megatron)."""
    return graphed_router_error(setting).render(flag_of)


def job_layers(config: MechmonConfig, num_layers: Optional[int]) -> dict[str, int]:
    """The job's tests counted from below (the per-test probability ``R / (N C)`` is largest for
    the fewest): the attention families the flags switch on, optional ones left out, over
    ``num_layers`` when known; else one Delta2 test."""
    if "attn" in config.monitors and num_layers:
        return {spec.name: num_layers for spec in FAMILIES
                if spec.monitor == "attn" and not spec.optional and switched_on(config, spec)}
    return {ATTN_DELTA2.name: 1}


def check_detector(config: MechmonConfig, layers: Mapping[str, int]) -> None:
    """The calibration file, then the false-alarm rate of a job of ``layers`` (family -> layers).

    ``ConfigError`` when the file is no table (``detector_calibration``), when the per-test
    probability is not in (0, 1), or when it lies beyond the measured tail of some family (above
    its ``P0(S > u0)``: the threshold would fall to the bottom of the fit, alarming on nearly every
    check, and the false-alarm rate would no longer be what was asked for) (``false_alarm_rate``).

    The thresholds themselves are not computed here (the session computes them once, from the
    job's real shape, ``detector_setup.build_detector``): what passes is enough for
    ``thresholds_for_job`` to succeed. It raises only when the per-test probability is not in
    (0, 1) (checked here, ``per_test_probability``; halved for a Shewhart split, and capped at 0.5
    times a factor >= 1 for the warnings: still in (0, 1)), when a family's tail at this overlap is
    missing, at either level, or when some probability in (0, 1) gets no finite threshold from it
    (checked by ``load_detector_design`` on every family this configuration can feed, a superset
    of the job's, and on the Shewhart tails when they are asked for: ``NullTail.bounded``).
    """
    _, table = load_detector_design(config)  # names the setting and the file
    shape = JobShape(layers=dict(layers), interval=config.interval, overlap=config.overlap)
    rate = config.false_alarm_rate
    per_test = per_test_probability(shape, rate)
    floors = {(family, level): table.tail(config.overlap, family, level)[0].log_p_u0
              for family in detector_families(config) for level in TAIL_LEVELS}
    (family, level), lowest = min(floors.items(), key=lambda item: item[1])
    if math.log(per_test) >= lowest:
        most = math.exp(lowest) * max(1, shape.num_tests()) * shape.checks_per_million()
        source = literal(config.detector_calibration or "shipped")
        raise ConfigError(
            "false_alarm_rate",
            f"{rate:g} is beyond the measured null tails: each test would alarm falsely with probability "
            f"{per_test:.3g} per check, more than P0(S > u0) = {math.exp(lowest):.3g} of {family} ({level} test, "
            f"$detector_calibration {source}); use a rate below {most:.3g} per 10^6 steps for a check every "
            f"{config.interval} steps",
        )


def _check_collective_timeout(config: MechmonConfig, facts: RunFacts) -> None:
    """A monitor collective must give up well before the host's own collectives do: a rank that
    left a monitor collective early trains on, and its peers must rejoin training before the
    host's timeout fires (``session/collective_guard.py``)."""
    host = facts.host_timeout_s
    if host is not None and config.collective_timeout >= 0.5 * host:
        raise ConfigError(
            "collective_timeout",
            f"{config.collective_timeout:g} s must be below half of the host's {literal(facts.host_timeout_flag)} "
            f"({host:g} s): a rank whose monitor collective failed trains on, and its peers must give up the "
            "monitor collective and rejoin training before the host's own timeout fires",
        )


def _check_save_dir(config: MechmonConfig, facts: RunFacts) -> None:
    flag = literal(facts.save_flag)
    if not facts.save_dir:
        raise ConfigError(
            "action",
            f"checkpoint-and-abort saves a checkpoint at the alarm, but {flag} is not set: the progress since the "
            f"last save would be lost; set {flag} DIR, or choose $action warn",
        )
    problem = directory_problem(facts.save_dir)
    if problem:
        raise ConfigError(
            "action",
            f"checkpoint-and-abort needs a checkpoint folder it can write, but {flag} "
            f"{literal(repr(facts.save_dir))} {literal(problem)}",
        )


def _schedule_warnings(config: MechmonConfig, facts: RunFacts) -> list[ConfigNote]:
    out: list[ConfigNote] = []
    iters = facts.train_iters
    attn = "attn" in config.monitors
    if iters is not None and iters >= 1:
        if config.interval > iters:
            out.append(ConfigNote("interval", f"{config.interval} > --train-iters {iters}: no check runs in this "
                                              "job, nothing will be checked"))
        elif attn:
            first = config.interval * math.ceil(config.delta / config.interval)  # first check with a snapshot
            if first > iters:
                out.append(ConfigNote(
                    "delta",
                    f"{config.delta}: the first attention check (iteration {first}, once a snapshot {config.delta} "
                    f"steps old exists) comes after --train-iters {iters}: the attention monitors will check "
                    "nothing in this job",
                ))
        if config.drill_at is not None and config.drill_at > iters:
            out.append(ConfigNote("drill_at", f"{config.drill_at} > --train-iters {iters}: the drill will never run"))
    if attn and config.overlap > QUIET_SNAPSHOT_SETS:
        memory = ""
        if facts.snapshot_set_bytes:
            total = facts.snapshot_set_bytes * config.overlap
            memory = f", about {total / MIB:.0f} MiB per rank ({facts.snapshot_set_bytes / MIB:.1f} MiB each)"
        out.append(ConfigNote(
            "delta",
            f"{config.delta} / $interval {config.interval}: {config.overlap} snapshot sets of the Q/K weights are "
            f"held at once{memory}; a delta of a few intervals holds fewer",
        ))
    return out
