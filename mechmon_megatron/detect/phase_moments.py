"""The early-phase correction: a young baseline's residual, standardised by the healthy null of its phase.

Early in training a stream's baseline is *young*: its window holds fewer than ``TrendConfig.window``
values. On healthy runs its residual ``z`` (``robust_trend``) is then not centred at 0 with unit
scale, and how far off it is depends on the phase of training: the attention entropies still rise
after the warm-up (only a fault-side slope is extrapolated, so the centre lags on the safe side:
``z`` sits below 0) and a window of few values has a wide robust scale. A fault that starts in that
phase is judged against a null the CUSUM's thresholds, set by the late phase, barely spend.

The correction measures that null on the calibration's healthy runs and undoes it. For a family
whose :attr:`~mechmon_megatron.detect.families.FamilySpec.phase_corrected` is set, the residuals
of every young baseline are grouped by training step into bins of ``bin_steps`` steps; bin ``b``
(steps ``[b * bin_steps, (b + 1) * bin_steps)``) has the robust centre and scale

    c_b = median(z),    s_b = 1.4826 * median(|z - c_b|)

over every stream and run in it. While a stream's baseline is young and its check falls in a
measured bin, the detector judges ``z' = (z - c_b) / s_b`` instead of ``z`` (clipped and pooled as
before). A check outside every measured bin (a baseline re-learned after an alarm late in the run,
a run longer than the calibration's young phase) is judged uncorrected: the moments are never
extrapolated. A grown baseline is never corrected: its residual follows the null the tails were
fitted on.

The moments hold for what they were measured on: the check interval and window (``delta``),
which set how long a baseline stays young; the learning-rate warm-up, decay style and peak
learning rate, which set the phase and how fast the weights move in it (the shipped moments, at
peak 2e-3, added attention alarms to runs at 8e-3); and the kind of attention (``standard`` or
``mla``: multi-head latent attention's Delta2 is its content part, whose early rise differs; the
shipped moments, from a grouped-query model, raised false alarms on healthy MLA runs).
:func:`select_phase_table` picks the table of a calibration file that matches a job and says, in
one line, why the correction is off when none does.

Pure Python, standard library only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from mechmon_megatron.detect.families import FAMILY_BY_NAME, FAMILY_NAMES

__all__ = [
    "ATTENTION_KINDS",
    "DEFAULT_BIN_STEPS",
    "LATENT_ATTENTION",
    "MIN_BIN_SAMPLES",
    "PhaseBin",
    "PhaseTable",
    "STANDARD_ATTENTION",
    "TrainingSchedule",
    "attention_kind_of",
    "fit_phase_table",
    "phase_tables_from_list",
    "select_phase_table",
]

DEFAULT_BIN_STEPS = 200
"""Width of a phase bin (training steps): ten checks at interval 20."""
MIN_BIN_SAMPLES = 30
"""Young-baseline residuals a bin needs before its moments are used (fewer: the bin is left out)."""
_MAD_TO_SIGMA = 1.4826
STANDARD_ATTENTION = "standard"
"""Multi-head or grouped-query attention."""
LATENT_ATTENTION = "mla"
"""Multi-head latent attention (MLA): its Delta2 stream is the content part."""
ATTENTION_KINDS = (STANDARD_ATTENTION, LATENT_ATTENTION)
"""Attention kinds a phase table is measured on."""


def attention_kind_of(latent: bool) -> str:
    """The attention kind of a job or run: :data:`LATENT_ATTENTION` when any of its monitored layers
    is latent (``latent``), else :data:`STANDARD_ATTENTION` (a job mixes no kinds in practice; the
    latent one decides, so grouped-query moments never correct an MLA stream)."""
    return LATENT_ATTENTION if latent else STANDARD_ATTENTION


@dataclass(frozen=True, slots=True)
class TrainingSchedule:
    """What of a job's learning-rate schedule the phase moments depend on."""

    lr_warmup_steps: int
    """Steps of linear learning-rate warm-up (Megatron's ``--lr-warmup-iters``)."""
    lr_decay_style: str
    """The decay after the warm-up (Megatron's ``--lr-decay-style``: ``cosine``, ``linear``, ``WSD``, ...)."""
    peak_lr: Optional[float] = None
    """Peak learning rate (Megatron's ``--lr``); None: not known (a job) or not recorded (a table
    of a file written before tables recorded it). None never matches."""

    def matches(self, job: TrainingSchedule) -> bool:
        """Whether phase moments measured with this schedule hold for ``job``: the same warm-up and
        decay style and the same, known, peak learning rate (equal to 1e-9 relative: a flag's
        float written and read back)."""
        return (self.lr_warmup_steps == job.lr_warmup_steps and self.lr_decay_style == job.lr_decay_style
                and self.peak_lr is not None and job.peak_lr is not None
                and math.isclose(self.peak_lr, job.peak_lr, rel_tol=1e-9))

    def describe(self) -> str:
        peak = "peak learning rate unknown" if self.peak_lr is None else f"peak learning rate {self.peak_lr:g}"
        return f"{self.lr_warmup_steps}-step warm-up, {self.lr_decay_style} decay, {peak}"


@dataclass(frozen=True, slots=True)
class PhaseBin:
    """The healthy null of young-baseline residuals in one bin of training steps (residual units)."""

    start: int
    """First training step of the bin."""
    centre: float
    scale: float
    """Robust scale, > 0."""
    samples: int


@dataclass(frozen=True)
class PhaseTable:
    """Phase moments measured at one check schedule and learning-rate schedule."""

    interval: int
    delta: int
    schedule: TrainingSchedule
    bin_steps: int
    families: Mapping[str, tuple[PhaseBin, ...]] = field(default_factory=dict)
    """Family -> its measured bins, sorted by ``start`` (bins with too few residuals are absent)."""
    attention: str = STANDARD_ATTENTION
    """The attention kind of the runs measured (:data:`ATTENTION_KINDS`)."""

    def bin_of(self, family: str, step: int) -> Optional[PhaseBin]:
        """The measured bin holding ``step`` for ``family``, or None (not measured: no correction)."""
        start = (step // self.bin_steps) * self.bin_steps
        for b in self.families.get(family, ()):
            if b.start == start:
                return b
        return None

    def standardise(self, family: str, step: int, z: float) -> float:
        """``(z - c_b) / s_b`` for the bin of ``step``; ``z`` itself outside every measured bin."""
        b = self.bin_of(family, step)
        return z if b is None else (z - b.centre) / b.scale

    def covered_until(self) -> int:
        """One past the last step any family's bins measure (0 for an empty table)."""
        ends = [bins[-1].start + self.bin_steps for bins in self.families.values() if bins]
        return max(ends, default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "interval": self.interval,
            "delta": self.delta,
            "lr_warmup_steps": self.schedule.lr_warmup_steps,
            "lr_decay_style": self.schedule.lr_decay_style,
            "peak_lr": self.schedule.peak_lr,
            "bin_steps": self.bin_steps,
            "attention": self.attention,
            "families": {f: [[b.start, b.centre, b.scale, b.samples] for b in bins]
                         for f, bins in sorted(self.families.items())},
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "phase") -> PhaseTable:
        """One entry of a calibration file's ``phase`` list; ``ValueError`` naming the bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be an object, got {type(data).__name__}")

        def integer(name: str, minimum: int) -> int:
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{where}.{name} must be an integer >= {minimum}, got {value!r}")
            return value

        style = data.get("lr_decay_style")
        if not isinstance(style, str) or not style:
            raise ValueError(f"{where}.lr_decay_style must be a non-empty string, got {style!r}")
        peak_lr = data.get("peak_lr")  # absent in a file of the first design: never matches a job
        if peak_lr is not None and (isinstance(peak_lr, bool) or not isinstance(peak_lr, (int, float))
                                    or not math.isfinite(peak_lr) or peak_lr <= 0):
            raise ValueError(f"{where}.peak_lr must be a finite number > 0 or null, got {peak_lr!r}")
        families = data.get("families")
        if not isinstance(families, Mapping):
            raise ValueError(f"{where}.families must be an object {{family: [[start, centre, scale, samples], ...]}}")
        bin_steps = integer("bin_steps", 1)
        attention = data.get("attention", STANDARD_ATTENTION)
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"{where}.attention must be one of {list(ATTENTION_KINDS)}, got {attention!r}")
        checked: dict[str, tuple[PhaseBin, ...]] = {}
        for family, rows in families.items():
            if family not in FAMILY_BY_NAME:
                raise ValueError(f"{where}.families: unknown family {family!r}; known: {sorted(FAMILY_NAMES)}")
            if not isinstance(rows, Sequence) or isinstance(rows, str):
                raise ValueError(f"{where}.families[{family!r}] must be a list of [start, centre, scale, samples]")
            bins = tuple(_phase_bin(row, f"{where}.families[{family!r}][{i}]", bin_steps)
                         for i, row in enumerate(rows))
            if [b.start for b in bins] != sorted({b.start for b in bins}):
                raise ValueError(f"{where}.families[{family!r}]: bin starts must increase")
            checked[str(family)] = bins
        return cls(interval=integer("interval", 1), delta=integer("delta", 1),
                   schedule=TrainingSchedule(integer("lr_warmup_steps", 0), style,
                                             None if peak_lr is None else float(peak_lr)),
                   bin_steps=bin_steps, families=checked, attention=attention)


def _phase_bin(row: Any, where: str, bin_steps: int) -> PhaseBin:
    if not isinstance(row, Sequence) or isinstance(row, str) or len(row) != 4:
        raise ValueError(f"{where} must be [start, centre, scale, samples], got {row!r}")
    start, centre, scale, samples = row
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start % bin_steps:
        raise ValueError(f"{where}: start must be a multiple of bin_steps {bin_steps} and >= 0, got {start!r}")
    for name, value in (("centre", centre), ("scale", scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    if scale <= 0:
        raise ValueError(f"{where}: scale must be > 0, got {scale!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{where}: samples must be an integer >= 1, got {samples!r}")
    return PhaseBin(start=start, centre=float(centre), scale=float(scale), samples=samples)


def phase_tables_from_list(data: Any) -> tuple[PhaseTable, ...]:
    """A calibration file's ``phase`` section (a list of :meth:`PhaseTable.to_dict` entries)."""
    if not isinstance(data, Sequence) or isinstance(data, str):
        raise ValueError(f'"phase" must be a list of phase tables, got {type(data).__name__}')
    tables = tuple(PhaseTable.from_dict(entry, f"phase[{i}]") for i, entry in enumerate(data))
    keys = [(t.interval, t.delta, t.schedule, t.attention) for t in tables]
    if len(set(keys)) != len(keys):
        raise ValueError('"phase" has two tables for one interval, delta, schedule and attention kind')
    return tables


def fit_phase_table(
    residuals: Mapping[str, Iterable[tuple[int, float]]],
    interval: int,
    delta: int,
    schedule: TrainingSchedule,
    bin_steps: int = DEFAULT_BIN_STEPS,
    min_samples: int = MIN_BIN_SAMPLES,
    attention: str = STANDARD_ATTENTION,
) -> PhaseTable:
    """The phase moments of healthy young-baseline residuals: ``residuals`` maps a family to its
    ``(training step, z)`` pairs (every young stream at every check of every healthy run,
    unclipped). A bin with fewer than ``min_samples`` pairs, or with a zero scale, is left out."""
    if bin_steps < 1 or min_samples < 1:
        raise ValueError(f"bin_steps and min_samples must be >= 1, got {bin_steps}, {min_samples}")
    families: dict[str, tuple[PhaseBin, ...]] = {}
    for family, pairs in residuals.items():
        by_bin: dict[int, list[float]] = {}
        for step, z in pairs:
            if math.isfinite(z):
                by_bin.setdefault((step // bin_steps) * bin_steps, []).append(z)
        bins = []
        for start in sorted(by_bin):
            zs = by_bin[start]
            if len(zs) < min_samples:
                continue
            centre = statistics.median(zs)
            scale = _MAD_TO_SIGMA * statistics.median(abs(z - centre) for z in zs)
            if scale > 0:
                bins.append(PhaseBin(start=start, centre=centre, scale=scale, samples=len(zs)))
        families[family] = tuple(bins)
    return PhaseTable(interval=interval, delta=delta, schedule=schedule, bin_steps=bin_steps, families=families,
                      attention=attention)


def select_phase_table(
    tables: Sequence[PhaseTable], interval: int, delta: int, schedule: Optional[TrainingSchedule],
    attention: str = STANDARD_ATTENTION,
) -> tuple[Optional[PhaseTable], str]:
    """The table measured at the job's interval, delta, schedule and attention kind, and one line
    for the start-up log: why the correction is off (no table, no table for this check schedule,
    another or an unknown learning-rate schedule, another attention kind), or which steps it covers."""
    if not tables:
        return None, ("the calibration has no phase moments (a file written before the early-phase "
                      "correction): young baselines are judged uncorrected; refit it with mechmon-calibrate")
    at_schedule = [t for t in tables if t.interval == interval and t.delta == delta and t.covered_until() > 0]
    if not at_schedule:
        measured = ", ".join(f"interval {t.interval} delta {t.delta}" for t in tables)
        return None, (f"no phase moments for interval {interval} delta {delta} (measured: {measured}; a table "
                      "without bins has too few young-baseline residuals): the early-phase correction is off")
    if schedule is None:
        return None, ("the job's learning-rate schedule is unknown to mechmon: the early-phase correction "
                      f"(measured with a {at_schedule[0].schedule.describe()}) is off")
    for table in at_schedule:
        if table.schedule.matches(schedule) and table.attention == attention:
            return table, (f"early-phase correction on: young baselines of steps 0-{table.covered_until()} are "
                           f"standardised by the healthy null of their {table.bin_steps}-step phase "
                           f"(measured with a {schedule.describe()}, {attention} attention)")
    kinds = sorted({t.attention for t in at_schedule if t.schedule.matches(schedule)})
    if kinds:
        return None, (f"the phase moments were measured on {', '.join(kinds)} attention, this job has {attention} "
                      "attention: the early-phase correction is off (refit with mechmon-calibrate on healthy runs "
                      "of this model)")
    measured = "; ".join(t.schedule.describe() for t in at_schedule)
    if all(t.schedule.peak_lr is None for t in at_schedule):
        why = "a file written before phase tables recorded it; refit with mechmon-calibrate --lr"
        return None, (f"the phase moments do not record their peak learning rate ({why}): the early-phase "
                      f"correction is off (measured with a {measured}; this job has a {schedule.describe()})")
    if schedule.peak_lr is None:
        return None, ("the job's peak learning rate is unknown to mechmon: the early-phase correction "
                      f"(measured with a {measured}) is off")
    return None, (f"the phase moments were measured with a {measured}, this job has a {schedule.describe()}: "
                  "the early-phase correction is off (refit with mechmon-calibrate on healthy runs of this "
                  "schedule)")
