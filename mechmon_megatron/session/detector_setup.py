"""The session's whole-job detector: which layers the job monitors, the thresholds, the alerts.

Every rank sends the layer numbers of its monitored sites with each check; the writer rank builds
:class:`~mechmon_megatron.detect.pooled_cusum.PooledCusumDetector` at the first check from
their union (the job shape the union bound counts), with thresholds set from
``MechmonConfig.false_alarm_rate`` through the null tails (shipped, or
``detector_calibration``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from mechmon_megatron.detect.config_error import ConfigError, Spelling, literal, substitute
from mechmon_megatron.detect.families import FAMILIES, FamilySpec, family_spec
from mechmon_megatron.detect.null_model import (
    TAIL_LEVELS,
    JobShape,
    TailTable,
    ThresholdAccount,
    load_tail_table,
    thresholds_for_job,
)
from mechmon_megatron.detect.phase_moments import STANDARD_ATTENTION, PhaseTable, TrainingSchedule, select_phase_table
from mechmon_megatron.detect.pooled_cusum import (
    MIN_WARMUP_CHECKS,
    WARMUP_STEPS,
    PooledAlarm,
    PooledCusumDetector,
    SequentialConfig,
    default_sequential_config,
)
from mechmon_megatron.session.alert import Alert
from mechmon_megatron.session.config import MechmonConfig, flag_of
from mechmon_megatron.session.log import mechmon_log

if TYPE_CHECKING:  # annotations only: the start-up check (session/startup.py) runs without torch
    from mechmon_megatron.session.host import AttentionSite, RouterSite

log = mechmon_log(__name__)

SHIPPED_CALIBRATION = "shipped (mechmon_megatron/detect/null_tails.json)"
"""How the account names the tail table the package ships."""


def switched_on(config: MechmonConfig, spec: FamilySpec) -> bool:
    """Whether the configuration's switch of the family (``FamilySpec.switch``) is on; a family
    without a switch is on whenever its monitor has a layer."""
    return spec.switch is None or bool(getattr(config, spec.switch))


def local_layers(
    config: MechmonConfig, attention_sites: Sequence[AttentionSite], router_sites: Sequence[RouterSite]
) -> dict[str, list[int]]:
    """Family -> global layer numbers this rank's sites feed (sorted)."""
    by_monitor = {"attn": sorted({s.layer_number for s in attention_sites}),
                  "router": sorted({s.layer_number for s in router_sites})}
    return {spec.name: by_monitor[spec.monitor] for spec in FAMILIES
            if by_monitor[spec.monitor] and switched_on(config, spec)}


def job_shape(config: MechmonConfig, per_rank: Iterable[Mapping[str, Sequence[int]]]) -> JobShape:
    """The union of every rank's layers, as the union bound counts them."""
    layers: dict[str, set[int]] = {}
    for rank_layers in per_rank:
        for family, numbers in rank_layers.items():
            layers.setdefault(family, set()).update(numbers)
    return JobShape(layers={f: len(v) for f, v in sorted(layers.items())}, interval=config.interval,
                    overlap=config.overlap)


def detector_families(config: MechmonConfig) -> tuple[str, ...]:
    """The detector families this configuration can feed: every family that is not optional
    (the shipped calibration covers them), plus each optional one whose switch is on
    (``short_window``) when its monitor is (``FamilySpec.optional``)."""
    return tuple(spec.name for spec in FAMILIES
                 if not spec.optional or (switched_on(config, spec) and spec.monitor in config.monitors))


def families_without_signal(config: MechmonConfig, shape: JobShape,
                            spell: Spelling = flag_of) -> dict[str, str]:
    """Families this configuration could feed that no layer of the job feeds, with why: they are
    left out of the union bound (``JobShape`` counts only the families it has), and the session
    says so once at start-up rather than judging a silent zero. Settings are named in ``spell``."""
    out: dict[str, str] = {}
    for family in detector_families(config):
        if not shape.layers.get(family):
            spec = family_spec(family)
            # A family its switch turned off says so; otherwise nothing of its monitor was found.
            off = spec.switch is not None and not switched_on(config, spec)
            out[family] = spell(spec.switch) if off and spec.switch else substitute(spec.no_signal, spell)
    return out


def fed_families(config: MechmonConfig, layers: Mapping[str, Sequence[int]]) -> tuple[str, ...]:
    """The detector families a job feeds, as one rank sees it: the families of ``layers`` (this
    rank's sites, :func:`local_layers`), else every family the flags can feed."""
    families = tuple(f for f in detector_families(config) if layers.get(f))
    if families:
        return families
    return tuple(f for f in detector_families(config) if family_spec(f).monitor in config.monitors)


def first_value_step(config: MechmonConfig, family: str, start: int) -> int:
    """The first check after ``start`` (the iteration training starts or resumes at) that gives a
    stream of ``family`` a value. Routers: the first check. The attention families compare with a
    snapshot one window old (``delta``; ``interval`` for the short window) that was taken at or
    after ``start``: snapshots are not kept in checkpoints, so a restart waits one window."""
    interval = config.interval
    window = {"check": 1, "interval": interval, "delta": config.delta}[family_spec(family).window]
    return interval * math.ceil((start + window) / interval)


def held_values(detector_state: Optional[Mapping[str, Any]]) -> dict[str, int]:
    """Family -> the most baseline values one stream of it holds in a saved detector state."""
    held: dict[str, int] = {}
    for family, _layer, _member, values in (detector_state or {}).get("trends", []):
        held[family] = max(held.get(family, 0), len(values))
    return held


def arm_step(config: MechmonConfig, design: SequentialConfig, start: int, families: Iterable[str],
             held: Mapping[str, int]) -> dict[str, int]:
    """Family -> the check at which it gives the detector its first statistic (a residual, a
    CUSUM: the ``mechmon/detect/*`` scalars), for a run that starts at ``start``.

    The detector judges a stream once its baseline holds ``warmup`` values
    (``TrendConfig.warmup``: ``max(5, ceil(200 / interval))`` checks, the 200-step warm-up of
    ``pooled_cusum.warmup_checks``); every check with a value adds one. So a family arms
    ``warmup - held`` checks after its first value, ``held`` being what the checkpoint's baselines
    already hold. Exceptions make it later, never earlier: a routing entropy below its floor is
    kept out of the baseline (the floor judges it), and an alarm restarts the baselines of its
    layer or family."""
    out = {}
    for family in families:
        need = max(0, design.trend_of(family).warmup - int(held.get(family, 0)))
        out[family] = first_value_step(config, family, start) + need * config.interval
    return out


def arming_line(config: MechmonConfig, design: SequentialConfig, start: int, families: Sequence[str],
                held: Mapping[str, int]) -> tuple[int, str]:
    """``(step, why)``: the step the detector arms at (its first statistic, of any family) and
    why then, for the start-up line (``[mechmon] detector arms at step N: why``)."""
    steps = arm_step(config, design, start, families, held)
    step = min(steps.values())
    warmup = design.trend_of(families[0]).warmup
    interval = config.interval
    specs = [family_spec(f) for f in families]
    groups: dict[tuple[int, bool, int], list[FamilySpec]] = {}
    for spec in specs:
        key = (first_value_step(config, spec.name, start), spec.monitor == "router", int(held.get(spec.name, 0)))
        groups.setdefault(key, []).append(spec)
    firsts = []
    for (first, _router, kept), group in sorted(groups.items(), key=lambda item: item[0]):
        labels = list(dict.fromkeys(spec.label for spec in group))  # families that share a label: once
        notes = []
        if any(spec.window == "delta" for spec in group):
            notes.append(f"a snapshot --mechmon-delta {config.delta} steps old")
        if kept:
            notes.append("baseline from the checkpoint" if kept >= warmup else f"{kept} values from the checkpoint")
        firsts.append(f"{'/'.join(labels)} at step {first}" + (f" ({', '.join(notes)})" if notes else ""))
    why = (f"each stream's baseline needs {warmup} checks (the {WARMUP_STEPS}-step warm-up at --mechmon-interval "
           f"{interval}, at least {MIN_WARMUP_CHECKS} checks) before the detector judges it; first values: "
           f"{', '.join(firsts)}; "
           f"until then no mechmon/detect/* scalars, and only non-finite values"
           f"{' and the routing-entropy floor' if any(spec.monitor == 'router' for spec in specs) else ''} alarm")
    return step, why


def load_detector_design(config: MechmonConfig) -> tuple[SequentialConfig, TailTable]:
    """The detector's design for this schedule and its null tails, checked at start-up: a bad
    calibration file stops the job naming the setting (``ConfigError``, ``detector_calibration``),
    before any training step; a calibration without the tails of a family an option asks for
    stops it naming the family and the option (its switch, or ``detector_shewhart``)."""
    design = dataclasses.replace(default_sequential_config(config.interval), shewhart=config.detector_shewhart)
    source = literal(config.detector_calibration or "the shipped null_tails.json")
    families = detector_families(config)
    try:
        table = load_tail_table(config.detector_calibration)
        for family in families:  # every family must have a tail at this overlap
            if family_spec(family).optional:
                continue  # checked below, with the option's own message
            _check_tails(table, config.overlap, family, shewhart=False)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError("detector_calibration",
                          f": no usable null-tail table in {source}: {literal(exc)}") from None
    for family in (f for f in families if family_spec(f).optional):
        switch = family_spec(family).switch
        try:
            table.tail(config.overlap, family, "layer")
        except KeyError:
            raise ConfigError(
                str(switch),
                f": the calibration {source} has no null tail for detector family {family!r}; fit one with "
                f"mechmon-calibrate on healthy runs recorded with ${switch} and pass it with "
                "$detector_calibration, or drop the flag",
            ) from None
        try:
            _check_tails(table, config.overlap, family, shewhart=False)
        except ValueError as exc:
            raise ConfigError("detector_calibration",
                              f": no usable null-tail table in {source}: {literal(exc)}") from None
    if design.shewhart:
        try:
            for family in families:
                table.shewhart_tail(config.overlap, family, "layer")
        except KeyError as exc:
            raise ConfigError(
                "detector_shewhart",
                f": the calibration {source} has no Shewhart tails ({literal(exc.args[0])}); refit it with "
                "mechmon-calibrate (it writes a `shewhart` section) or drop the flag.",
            ) from None
        try:
            for family in families:
                _check_tails(table, config.overlap, family, shewhart=True)
        except ValueError as exc:
            raise ConfigError("detector_calibration",
                              f": no usable null-tail table in {source}: {literal(exc)}") from None
    return design, table


def _check_tails(table: TailTable, overlap: int, family: str, shewhart: bool) -> None:
    """The tails of ``family`` at ``overlap`` that ``thresholds_for_job`` reads (both levels; the
    ``family`` level falls back to the ``layer`` tail of the same measured overlap): present
    (``KeyError``) and bounded, every probability in (0, 1) with a finite threshold (``ValueError``).
    With these, a per-test probability in (0, 1) is all ``thresholds_for_job`` needs."""
    for level in TAIL_LEVELS:
        tail, _ = table.shewhart_tail(overlap, family, level) if shewhart else table.tail(overlap, family, level)
        if not tail.bounded():
            kind = "Shewhart tail" if shewhart else "tail"
            raise ValueError(f"the {kind} of {family!r} ({level} test) at overlap {overlap} has theta "
                             f"{tail.theta:.3g}, too small for a finite threshold")


def phase_for_job(config: MechmonConfig, table: TailTable, schedule: Optional[TrainingSchedule],
                  attention: str = STANDARD_ATTENTION) -> tuple[Optional[PhaseTable], str]:
    """The phase moments of ``table`` that match the job's check schedule, learning-rate
    ``schedule`` (None: the host could not say) and ``attention`` kind (``AttentionSite.attention``),
    and the one line the writer logs about them (``detect.phase_moments.select_phase_table``)."""
    return select_phase_table(table.phase, config.interval, config.delta, schedule, attention)


def build_detector(
    config: MechmonConfig, shape: JobShape, design: SequentialConfig, table: TailTable,
    phase: Optional[PhaseTable] = None,
) -> tuple[PooledCusumDetector, ThresholdAccount]:
    """The detector and the account of its thresholds (logged once by the writer); ``phase``: the
    early-phase correction (:func:`phase_for_job`)."""
    thresholds, account = thresholds_for_job(shape, config.false_alarm_rate, table, shewhart=design.shewhart)
    account = dataclasses.replace(account, calibration=config.detector_calibration or SHIPPED_CALIBRATION)
    for note in account.notes:
        log.warning("detector: %s", note)
    detector = PooledCusumDetector(thresholds, design, warning_probability=account.warning_per_test_check_probability,
                                   phase=phase)
    return detector, account


def _head_index(member: str) -> Optional[int]:
    return int(member[5:]) if member.startswith("head_") and member[5:].isdigit() else None


def alert_of(alarm: PooledAlarm, config: MechmonConfig, design: SequentialConfig,
             spell: Spelling = flag_of) -> Alert:
    """The alert record of a fired alarm (``spell``: how its reason names the settings).

    ``first_warning_step`` is the earliest step the shift can have begun: for a CUSUM alarm the
    first check after the CUSUM's last zero saw the window ``(change + interval - delta, ...]``;
    for the absolute limit, which judges a stream while it has no baseline, the start of the
    window of the first check of that period (the drift towards the limit may have begun before
    the values crossed it; a detector state of an older release: the first of its
    ``limit_patience`` checks).
    """
    heads = [h for h in (_head_index(m) for m in alarm.members) if h is not None]
    layer = alarm.layers[0] if alarm.layers else None
    if alarm.kind in ("shewhart", "cusum"):
        statistic = "residual" if alarm.kind == "shewhart" else "cusum"
        stream = f"mechmon/detect/{alarm.family}/{statistic}" + (f"/layer_{layer}" if alarm.level == "layer" else "")
        start = alarm.change_step if alarm.change_step is not None else alarm.step - config.interval
        first = max(0, start + config.interval - config.delta)
        test = (f"pooled residual {alarm.statistic:.3g} > Shewhart limit {alarm.threshold:.3g}"
                if alarm.kind == "shewhart" else f"CUSUM {alarm.statistic:.3g} > {alarm.threshold:.3g}")
        reason = (
            f"{alarm.family} shifted towards collapse: {test} "
            f"({alarm.level} test; set by {spell('false_alarm_rate')} {config.false_alarm_rate:g})"
        )
    elif alarm.kind == "limit":
        stream = f"{alarm.family}/layer_{layer}"
        first = (max(0, alarm.change_step - config.delta) if alarm.change_step is not None
                 else max(0, alarm.step - (design.limit_patience - 1) * config.interval))
        reason = alarm.reason
    else:
        stream = f"{alarm.family}/layer_{layer}"
        first = alarm.step
        reason = alarm.reason
    return Alert(
        iteration=alarm.step,
        family=alarm.family,
        stream=stream,
        layer=layer,
        head=heads[0] if heads else None,
        value=alarm.statistic,
        baseline=None,
        threshold=alarm.threshold,
        first_warning_step=first,
        reason=reason,
        level=alarm.level,
        kind=alarm.kind,
        layers=tuple(alarm.layers),
        heads=tuple(heads),
    )
