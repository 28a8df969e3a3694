"""From one false-alarm target to CUSUM thresholds: the measured null tail and the union bound.

The user sets ``R``, the expected number of false alarms per 1,000,000 training steps for the
whole job. A job runs ``N`` tests (per family: one CUSUM per layer, plus the pooled family
CUSUM when the family has more than one layer) at ``C = 10^6 / interval`` checks per million
steps. An alarm episode starts at a check where ``S > h``, so by the union bound

    E[false alarms per 10^6 steps] <= sum over tests of C * P0(S > h_test)

and it is enough that every test satisfies ``P0(S > h) <= p = R / (N C)``.

``P0`` is the null (healthy-run) distribution of the CUSUM statistic, measured by replaying the
detector on recorded healthy runs (:func:`fit_null_tail`). A CUSUM of bounded increments (the
residuals are clipped) has an exponential stationary tail, ``P0(S > h) ~ A exp(-theta h)``
(Cramer-Lundberg; for dependent increments theta is set by the long-run cumulant generating
function, so overlapping windows, ``delta > interval``, lower it). We fit it on the exceedances
over a high level ``u0`` of the measured ``S`` (maximum likelihood for an exponential excess,
which needs no independence across checks for its point estimate) and use theta at the lower
end of its one-sided confidence interval, so the thresholds err on the side of silence:

    h = u0 + (log P0(S > u0) - log p) / theta_lower.

**Shewhart option** (``SequentialConfig.shewhart``): each test also alarms when one check's pooled
residual ``u`` exceeds a limit ``c``. Its null tail ``P0(u > c)`` is fitted the same way on the
per-check residuals of the same healthy replays (``TailTable.shewhart``), and each test's
probability is split, ``p_cusum = (1 - SHEWHART_SHARE) p``, ``p_shewhart = SHEWHART_SHARE p``, so
the union bound still sums to ``R`` over both tests (docs/METHOD.md section 7).

The fitted tails of the shipped default (``null_tails.json``) were measured on the study's
healthy runs (docs/RESULTS.md, "Calibration"); ``mechmon-calibrate`` refits them on a
user's own healthy runs. Pure Python.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.detect.families import FAMILY_BY_NAME, FAMILY_NAMES
from mechmon_megatron.detect.phase_moments import PhaseTable, phase_tables_from_list
from mechmon_megatron.detect.pooled_cusum import FamilyThresholds, Thresholds

__all__ = [
    "DEFAULT_FALSE_ALARM_RATE",
    "DEFAULT_WARNING_FACTOR",
    "SHEWHART_SHARE",
    "JobShape",
    "NullTail",
    "TailTable",
    "ThresholdAccount",
    "fit_null_tail",
    "load_tail_table",
    "per_test_probability",
    "thresholds_for_job",
]

DEFAULT_FALSE_ALARM_RATE = 0.01
"""Expected false alarms per 1,000,000 steps for the whole job (``MechmonConfig.false_alarm_rate``)."""

DEFAULT_WARNING_FACTOR = 1000.0
"""Warnings are set at ``R * factor`` (10 per million steps at the default R): sensitive, never act."""

SHEWHART_SHARE = 0.5
"""Share of each test's false-alarm probability given to its Shewhart limit (when on). Both
thresholds move with ``log p / theta``, so halving a test's ``p`` raises it by only
``log 2 / theta``; an even split is the choice that favours neither test and needs no fault data."""

_TAIL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "null_tails.json")


@dataclass(frozen=True, slots=True)
class NullTail:
    """``P0(S > h) = exp(log_p_u0 - theta (h - u0))`` for ``h >= u0`` (CUSUM units)."""

    u0: float
    log_p_u0: float
    theta: float
    """Decay rate used for thresholds (the lower confidence bound)."""
    theta_hat: float
    """Maximum-likelihood decay rate."""
    samples: int
    exceedances: int

    def log_survival(self, h: float) -> float:
        """log P0(S > h), the fitted tail (exact empirical anchor at ``u0``)."""
        return self.log_p_u0 - self.theta * max(0.0, h - self.u0)

    def threshold(self, probability: float) -> float:
        """Smallest ``h`` with fitted ``P0(S > h) <= probability``: defined for every probability in
        (0, 1) (``u0`` when the tail at ``u0`` is already below it; infinite when ``theta`` is so
        small that no finite ``h`` reaches it, e.g. a tiny theta scaled to 0 beyond the measured
        overlaps). ``ValueError`` for a probability outside (0, 1)."""
        if not 0 < probability < 1:
            raise ValueError(f"probability must be in (0, 1), got {probability}.")
        excess = self.log_p_u0 - math.log(probability)
        if excess <= 0:
            return self.u0
        return self.u0 + excess / self.theta if self.theta > 0 else math.inf

    def bounded(self) -> bool:
        """Every probability in (0, 1) has a finite threshold: the smallest positive float's has
        (the threshold falls as the probability rises). False only for a ``theta`` too small for
        any measured tail (below about 1e-305, or scaled to that beyond the measured overlaps)."""
        return math.isfinite(self.threshold(math.ulp(0.0)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _chi2_quantile(p: float, dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (accurate to ~1 % for dof >= 10)."""
    z = _normal_quantile(p)
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _normal_quantile(p: float) -> float:
    """Inverse standard normal CDF by bisection on erf (no scipy)."""
    lo, hi = -12.0, 12.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * (1.0 + math.erf(mid / math.sqrt(2.0))) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_null_tail(
    values: Iterable[float],
    tail_quantile: float = 0.95,
    confidence: float = 0.95,
    min_exceedances: int = 20,
    hard_min_exceedances: int = 5,
) -> NullTail:
    """Fit the exponential tail of the CUSUM statistic from healthy-run values (one per check
    and test). ``u0`` is the ``tail_quantile`` of the values, lowered until ``min_exceedances``
    values exceed it, never below 0 (the CUSUM sits at 0 much of the time); the excesses over
    it give theta. Few exceedances widen the confidence interval, so a data-starved fit is a
    cautious one. ValueError with fewer than ``hard_min_exceedances``."""
    xs = sorted(float(v) for v in values if math.isfinite(v))
    n = len(xs)
    if n == 0:
        raise ValueError("no null values to fit")
    wanted = max(min_exceedances, int(math.ceil((1.0 - tail_quantile) * n)))
    u0 = max(0.0, xs[n - wanted - 1]) if n > wanted else 0.0
    excess = [x - u0 for x in xs if x > u0]
    if len(excess) < hard_min_exceedances:
        raise ValueError(
            f"only {len(excess)} of {n} null values exceed u0={u0:.3g} (need {hard_min_exceedances}): "
            "record longer healthy runs."
        )
    k = len(excess)
    theta_hat = k / math.fsum(excess)
    # 2 k theta / theta_hat ~ chi2(2k) for exponential excesses: one-sided lower bound on theta.
    theta_low = theta_hat * _chi2_quantile(1.0 - confidence, 2 * k) / (2 * k)
    return NullTail(u0=u0, log_p_u0=math.log(k / n), theta=theta_low, theta_hat=theta_hat, samples=n, exceedances=k)


@dataclass(frozen=True, slots=True)
class JobShape:
    """What the union bound counts: layers per family and the check interval (steps)."""

    layers: Mapping[str, int]
    """Family -> number of layers it monitors in the whole job (all ranks)."""
    interval: int
    overlap: int = 1
    """``ceil(delta / interval)``: how many checks share one increment window."""

    def num_tests(self) -> int:
        return sum(n + (1 if n > 1 else 0) for n in self.layers.values() if n > 0)

    def checks_per_million(self) -> float:
        return 1e6 / self.interval


@dataclass
class TailTable:
    """Fitted null tails keyed by overlap, family and level (``layer`` / ``family``)."""

    tails: dict[int, dict[str, dict[str, NullTail]]]
    source: str = ""
    shewhart: dict[int, dict[str, dict[str, NullTail]]] = field(default_factory=dict)
    """Null tails of the per-check pooled residual ``u`` (same keys); empty in files written
    before the Shewhart option (the option is then refused at start-up)."""
    phase: tuple[PhaseTable, ...] = ()
    """The phase moments of young baselines, one table per measured check and learning-rate
    schedule (``detect/phase_moments.py``); empty in files written before the early-phase
    correction (it is then off, and the start-up log says so). The tails of a table with phase
    moments were fitted on replays that apply them."""

    def shewhart_tail(self, overlap: int, family: str, level: str) -> tuple[NullTail, str]:
        """The residual tail for this overlap: the smallest measured overlap >= ``overlap``, else
        the largest measured (a marginal tail: not scaled; the note says so). KeyError when the
        table has none for the family (a calibration file without a ``shewhart`` section)."""
        if not self.shewhart:
            raise KeyError("no Shewhart tails in this calibration (refit it with mechmon-calibrate)")
        measured = sorted(self.shewhart)
        usable = [m for m in measured if m >= overlap]
        m = usable[0] if usable else measured[-1]
        levels = self.shewhart[m].get(family)
        if levels is None:
            raise KeyError(f"no Shewhart tail for family {family!r} at overlap {m}")
        tail = levels.get(level) or levels["layer"]
        note = "" if m == overlap else f"overlap {overlap} uses the Shewhart tail measured at overlap {m}"
        return tail, note

    def tail(self, overlap: int, family: str, level: str) -> tuple[NullTail, str]:
        """The tail for this overlap, and a note when it is not a direct measurement.

        The smallest measured overlap >= ``overlap`` is used (more overlap, stronger
        autocorrelation, a heavier tail: conservative). Beyond the largest measured overlap,
        theta is scaled by ``measured / overlap`` (the long-run variance of a sum over
        ``overlap`` shared windows grows linearly with it), and the note says so.
        """
        measured = sorted(self.tails)
        usable = [m for m in measured if m >= overlap]
        if usable:
            m = usable[0]
            tail = self._lookup(m, family, level)
            note = "" if m == overlap else f"overlap {overlap} uses the tail measured at overlap {m} (conservative)"
            return tail, note
        m = measured[-1]
        tail = self._lookup(m, family, level)
        scale = m / overlap
        scaled = NullTail(
            u0=tail.u0,
            log_p_u0=tail.log_p_u0,
            theta=tail.theta * scale,
            theta_hat=tail.theta_hat * scale,
            samples=tail.samples,
            exceedances=tail.exceedances,
        )
        return scaled, f"overlap {overlap} > measured {m}: theta scaled by {scale:.3g} (an extrapolation)"

    def _lookup(self, overlap: int, family: str, level: str) -> NullTail:
        try:
            return self.tails[overlap][family][level]
        except KeyError:
            if level == "family":  # a family measured on one layer only: use its layer tail
                return self.tails[overlap][family]["layer"]
            raise KeyError(f"no null tail for family {family!r} level {level!r} at overlap {overlap}") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "tails": _tails_to_dict(self.tails)}
        if self.shewhart:  # files without the option stay byte-identical
            out["shewhart"] = _tails_to_dict(self.shewhart)
        if self.phase:
            out["phase"] = [t.to_dict() for t in self.phase]
        return out

    @classmethod
    def from_dict(cls, data: Any) -> TailTable:
        """The table of a calibration file's JSON; ``ValueError`` saying which entry is wrong.

        Checked here, once, so that no check later divides by a zero ``theta`` or compares a
        string: ``{"tails": {overlap: {family: {level: tail}}}}`` with overlaps positive integers,
        families of ``detect/families.py``, levels ``layer`` / ``family``, and every tail
        with the fields of :class:`NullTail` (``theta`` and ``theta_hat`` finite and > 0, ``u0``
        finite and >= 0, ``log_p_u0`` finite and <= 0, counts integers >= 1). The optional
        ``"shewhart"`` section (the tails of the Shewhart limits, ``MechmonConfig.detector_shewhart``)
        has the same shape and the same checks; the optional ``"phase"`` section is a list of
        :class:`~mechmon_megatron.detect.phase_moments.PhaseTable` entries.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("tails"), Mapping):
            raise ValueError('expected a JSON object {"tails": {overlap: {family: {level: tail}}}}, got '
                             f"{type(data).__name__}")
        if not data["tails"]:
            raise ValueError('"tails" is empty: no measured overlap')
        shewhart = data.get("shewhart") or {}
        if not isinstance(shewhart, Mapping):
            raise ValueError(f'"shewhart" must be an object {{overlap: {{family: {{level: tail}}}}}}, got '
                             f"{type(shewhart).__name__}")
        phase = data.get("phase")
        return cls(tails=_checked_tails(data["tails"], "tails"), source=str(data.get("source", "")),
                   shewhart=_checked_tails(shewhart, "shewhart"),
                   phase=() if phase is None else phase_tables_from_list(phase))


def _tails_to_dict(tails: Mapping[int, Mapping[str, Mapping[str, NullTail]]]) -> dict[str, Any]:
    return {
        str(m): {f: {lv: t.to_dict() for lv, t in levels.items()} for f, levels in fams.items()}
        for m, fams in sorted(tails.items())
    }


def _checked_tails(section: Mapping[Any, Any], name: str) -> dict[int, dict[str, dict[str, NullTail]]]:
    """One section of a calibration file (``tails`` or ``shewhart``), every entry checked."""
    tails: dict[int, dict[str, dict[str, NullTail]]] = {}
    for key, families in section.items():
        overlap = _overlap_key(key)
        if not isinstance(families, Mapping) or not families:
            raise ValueError(f"{name}[{key!r}] must be a non-empty object of families")
        tails[overlap] = {}
        for family, levels in families.items():
            if family not in FAMILY_BY_NAME:
                raise ValueError(f"{name}[{key!r}]: unknown family {family!r}; known: {sorted(FAMILY_NAMES)}")
            if not isinstance(levels, Mapping) or "layer" not in levels:
                raise ValueError(f"{name}[{key!r}][{family!r}] must be an object with a \"layer\" tail")
            tails[overlap][family] = {}
            for level, entry in levels.items():
                if level not in TAIL_LEVELS:
                    raise ValueError(f"{name}[{key!r}][{family!r}]: unknown level {level!r}; known: "
                                     f"{list(TAIL_LEVELS)}")
                tails[overlap][family][level] = _null_tail(entry, f"{name}[{key!r}][{family!r}][{level!r}]")
    return tails


TAIL_LEVELS = ("layer", "family")
_TAIL_FIELDS = {f.name for f in fields(NullTail)}


def _overlap_key(key: Any) -> int:
    """A measured overlap: a positive integer (JSON keys are strings: ``"1"``, ``"5"``)."""
    try:
        overlap = int(str(key).strip())
    except ValueError:
        overlap = 0
    if overlap < 1 or str(overlap) != str(key).strip():
        raise ValueError(f"overlap key {key!r} must be a positive integer (ceil(delta / interval))")
    return overlap


def _null_tail(data: Any, where: str) -> NullTail:
    if not isinstance(data, Mapping) or set(data) != _TAIL_FIELDS:
        got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"{where} must have exactly the fields {sorted(_TAIL_FIELDS)}, got {got}")

    def number(name: str, ok: Callable[[float], bool], rule: str) -> float:
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"{where}.{name} must be a finite number {rule}, got {value!r}")
        return float(value)

    def count(name: str) -> int:
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}.{name} must be an integer >= 1, got {value!r}")
        return value

    return NullTail(
        u0=number("u0", lambda v: v >= 0, ">= 0"),
        log_p_u0=number("log_p_u0", lambda v: v <= 0, "<= 0 (a log probability)"),
        theta=number("theta", lambda v: v > 0, "> 0 (the tail's decay rate)"),
        theta_hat=number("theta_hat", lambda v: v > 0, "> 0 (the tail's decay rate)"),
        samples=count("samples"),
        exceedances=count("exceedances"),
    )


def load_tail_table(path: Optional[str] = None) -> TailTable:
    """The shipped calibration (``detect/null_tails.json``) or a user's file.

    ``OSError`` when it cannot be read, ``ValueError`` (the entry named) when it is no table."""
    with open(path or _TAIL_FILE, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError("empty file" if not text.strip() else f"not JSON ({exc})") from None
    return TailTable.from_dict(data)


@dataclass(frozen=True)
class ThresholdAccount:
    """How one job's thresholds follow from its false-alarm rate (:func:`thresholds_for_job`).

    Probabilities are per test and per check; ``layers``: family -> layers (the job's tests are
    one per layer, plus one per family of more than one layer)."""

    false_alarm_rate_per_million_steps: float
    tests: int
    checks_per_million_steps: float
    per_test_check_probability: float
    """The CUSUM's share of ``R / (N C)`` (all of it without the Shewhart option)."""
    warning_per_test_check_probability: float
    overlap: int
    layers: Mapping[str, int]
    notes: tuple[str, ...]
    """Where a tail was taken from another overlap than the job's (logged once)."""
    thresholds: Mapping[str, FamilyThresholds]
    shewhart_share: Optional[float] = None
    """Share of each test's probability given to its Shewhart limit; None: the option is off."""
    shewhart_per_test_check_probability: Optional[float] = None
    calibration: Optional[str] = None
    """The tail table the thresholds came from (the session names it: a file, or the shipped one)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON: every field, the thresholds as ``{family: {"layer": {...}, "family": {...}}}``;
        the Shewhart keys only when the option is on, ``calibration`` only when named."""
        out: dict[str, Any] = {
            "false_alarm_rate_per_million_steps": self.false_alarm_rate_per_million_steps,
            "tests": self.tests,
            "checks_per_million_steps": self.checks_per_million_steps,
            "per_test_check_probability": self.per_test_check_probability,
            "warning_per_test_check_probability": self.warning_per_test_check_probability,
            "overlap": self.overlap,
            "notes": list(self.notes),
            "thresholds": {f: {"layer": _levels_dict(t.layer), "family": _levels_dict(t.family)}
                           for f, t in self.thresholds.items()},
            "layers": dict(self.layers),
        }
        if self.shewhart_share is not None:
            out["shewhart_share"] = self.shewhart_share
            out["shewhart_per_test_check_probability"] = self.shewhart_per_test_check_probability
        if self.calibration is not None:
            out["calibration"] = self.calibration
        return out


def per_test_probability(shape: JobShape, rate_per_million: float) -> float:
    """``p = R / (N C)``: the false-alarm probability each test may spend at one check.

    ``ConfigError`` (``false_alarm_rate``) unless the rate is a number > 0 and ``0 < p < 1``: a
    rate that large asks every test to alarm at nearly every check, and no threshold can do that."""
    if not (isinstance(rate_per_million, (int, float)) and math.isfinite(rate_per_million)
            and rate_per_million > 0):
        raise ConfigError("false_alarm_rate", f"must be a number > 0, got {rate_per_million!r}")
    tests = max(1, shape.num_tests())
    per_test = rate_per_million / (tests * shape.checks_per_million())
    if not 0 < per_test < 1:
        most = tests * shape.checks_per_million()
        raise ConfigError(
            "false_alarm_rate",
            f"{rate_per_million:g} asks each of the job's {tests} tests for a false alarm with probability "
            f"{per_test:.3g} at every check (every {shape.interval} steps), which must be below 1: use a rate "
            f"below {most:g} per 10^6 steps (the usual range is 0.001 to 100)",
        )
    return per_test


def thresholds_for_job(
    shape: JobShape,
    rate_per_million: float = DEFAULT_FALSE_ALARM_RATE,
    table: Optional[TailTable] = None,
    warning_factor: float = DEFAULT_WARNING_FACTOR,
    shewhart: bool = False,
) -> tuple[dict[str, FamilyThresholds], ThresholdAccount]:
    """Per-family thresholds for the job, and the account of how they were set (computed once per
    job: the session logs it, ``mechmon-scan`` writes it, both through ``ThresholdAccount.to_dict``).

    ``shewhart``: also set each test's Shewhart limit from ``table.shewhart``, with the test's
    probability split ``SHEWHART_SHARE`` to the limit and the rest to its CUSUM (KeyError when
    the table has no Shewhart tails). ``ConfigError`` (``false_alarm_rate``) from
    :func:`per_test_probability`."""
    if not warning_factor >= 1:
        raise ValueError(f"warning factor must be >= 1, got {warning_factor}.")
    table = table or load_tail_table()
    tests = max(1, shape.num_tests())
    per_test_total = per_test_probability(shape, rate_per_million)
    per_test = per_test_total * (1.0 - SHEWHART_SHARE) if shewhart else per_test_total
    per_test_shewhart = per_test_total * SHEWHART_SHARE
    per_test_warning = min(0.5, per_test * warning_factor)
    out: dict[str, FamilyThresholds] = {}
    notes: list[str] = []
    for family in sorted(shape.layers):
        levels = {}
        for level in ("layer", "family"):
            tail, note = table.tail(shape.overlap, family, level)
            if note and note not in notes:
                notes.append(note)
            warning, alarm = tail.threshold(per_test_warning), tail.threshold(per_test)
            limit = None
            if shewhart:
                residual_tail, note = table.shewhart_tail(shape.overlap, family, level)
                if note and note not in notes:
                    notes.append(note)
                limit = max(residual_tail.threshold(per_test_shewhart), 1e-6)
            levels[level] = Thresholds(warning=max(warning, 1e-6), alarm=max(alarm, warning, 1e-6), shewhart=limit)
        out[family] = FamilyThresholds(layer=levels["layer"], family=levels["family"])
    account = ThresholdAccount(
        false_alarm_rate_per_million_steps=rate_per_million,
        tests=tests,
        checks_per_million_steps=shape.checks_per_million(),
        per_test_check_probability=per_test,
        warning_per_test_check_probability=per_test_warning,
        overlap=shape.overlap,
        layers=dict(shape.layers),
        notes=tuple(notes),
        thresholds=dict(out),
        shewhart_share=SHEWHART_SHARE if shewhart else None,
        shewhart_per_test_check_probability=per_test_shewhart if shewhart else None,
    )
    return out, account


def _levels_dict(t: Thresholds) -> dict[str, Any]:
    out = asdict(t)
    if t.shewhart is None:  # the default design's account is unchanged
        del out["shewhart"]
    return out
