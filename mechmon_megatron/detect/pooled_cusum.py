"""The whole-job detector: standardised residuals, pooled per layer and per family, CUSUM.

One check delivers an :class:`Observation` per monitored stream (e.g. one per attention head
for ``attn_delta2``). Per family (the table of ``detect/families.py``):

1. **Residuals.** Each stream has a :class:`~mechmon_megatron.detect.robust_trend.RobustTrend`
   baseline; its standardised residual ``z`` (positive in the fault direction) is clipped to
   ``[-clip, clip]`` so that no single value can carry an alarm and the CUSUM's increments are
   bounded (what makes its null tail exponential, see ``detect.null_model``).
2. **Pooling.** A layer's statistic ``u_L`` is the trimmed mean (``trim`` of the members cut at
   each end) of its members' residuals: one noisy head moves it little, a coherent shift of
   many heads moves it fully. The family statistic ``u_F`` is the trimmed mean of the ``u_L``.
3. **Sequential test.** One-sided CUSUM per layer and per family:
   ``S_t = max(0, S_{t-1} + u_t - reference)``. ``S`` crossing the ``warning`` level is a
   warning (written, never acts); crossing ``alarm`` fires an alarm. The CUSUM's last zero
   before an alarm is its change-point estimate (``change_step``): the check after which the
   shift began.
4. **Baselines follow healthy drift, not faults.** After the decision, a finite value enters
   its stream's baseline unless its layer or its family is above the warning level (a suspected
   shift is not absorbed). After an alarm the layer (family: every layer) restarts: CUSUM 0,
   baselines re-learned from the next checks.
5. **Absolute limit** (the routing-entropy floor): while a stream has no baseline, a value
   beyond ``Observation.limit`` is kept out of the baseline and ``limit_patience`` consecutive
   such values fire an alarm, so a run that starts collapsed is judged by the limit.
6. A non-finite value fires an alarm for its layer at once.
7. **Option** (``SequentialConfig.shewhart``, default off): a test also alarms when one check's
   pooled residual ``u`` exceeds its Shewhart limit (``Thresholds.shewhart``), kind ``shewhart``.
8. **Calibration misfit** (``warning_probability`` given): per family, the warning episodes before
   its first alarm against the tail model's prediction (:mod:`~mechmon_megatron.detect.misfit`).
9. **Early-phase correction** (``phase`` given): while a stream of a ``phase_corrected`` family has
   a young baseline (fewer than ``window`` values), its residual is standardised by the healthy
   null of its training phase before it is clipped (:mod:`~mechmon_megatron.detect.phase_moments`).

Thresholds come from one false-alarm target through ``detect.null_model``. Pure Python;
``state_dict()`` is JSON-serialisable and a replay of recorded values reproduces the online
decisions exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, Optional

from mechmon_megatron.detect.families import FAMILIES, FAMILY_BY_NAME, ROUTER_WEIGHTS
from mechmon_megatron.detect.misfit import MisfitCounter
from mechmon_megatron.detect.phase_moments import PhaseTable
from mechmon_megatron.detect.robust_trend import Direction, RobustTrend, TrendConfig

__all__ = [
    "FAMILY_DIRECTIONS",
    "OPTIONAL_FAMILIES",
    "AlarmKind",
    "CheckResult",
    "FamilyThresholds",
    "Observation",
    "PooledAlarm",
    "PooledCusumDetector",
    "SequentialConfig",
    "Thresholds",
    "default_sequential_config",
    "trimmed_mean",
    "warmup_checks",
]

POOLED_STATE_VERSION = 1

FAMILY_DIRECTIONS: Mapping[str, Direction] = MappingProxyType({spec.name: spec.direction for spec in FAMILIES})
"""Fault direction of each family (read from ``detect/families.py``, where the families are declared):
entropies drop, router weight similarity rises."""

OPTIONAL_FAMILIES: tuple[str, ...] = tuple(spec.name for spec in FAMILIES if spec.optional)
"""Families a calibration file may lack (``FamilySpec.optional``): only a job that asks for one needs its tails."""

Level = Literal["layer", "family"]
AlarmKind = Literal["cusum", "shewhart", "limit", "nonfinite"]
"""The test that fired: a pooled CUSUM, its Shewhart option, a stream's absolute limit, a non-finite value."""


def trimmed_mean(values: Iterable[float], trim: float) -> float:
    """Mean after cutting ``floor(trim * n)`` values at each end (``trim`` in [0, 0.5))."""
    xs = sorted(values)
    if not xs:
        raise ValueError("trimmed_mean of no values")
    cut = int(math.floor(trim * len(xs)))
    kept = xs[cut : len(xs) - cut] or xs
    return math.fsum(kept) / len(kept)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """CUSUM levels (in pooled-residual units) of one test, and its optional Shewhart limit."""

    warning: float
    alarm: float
    shewhart: Optional[float] = None
    """One check whose pooled residual ``u`` exceeds this alarms at once (pooled-residual units);
    None: no Shewhart limit (the default design)."""

    def __post_init__(self) -> None:
        if not (0 < self.warning <= self.alarm and math.isfinite(self.alarm)):
            raise ValueError(f"thresholds need 0 < warning <= alarm < inf, got {self.warning}, {self.alarm}.")
        if self.shewhart is not None and not (math.isfinite(self.shewhart) and self.shewhart > 0):
            raise ValueError(f"a Shewhart limit must be finite and > 0, got {self.shewhart}.")


@dataclass(frozen=True, slots=True)
class FamilyThresholds:
    """Levels of a family's per-layer CUSUMs and of its pooled family CUSUM."""

    layer: Thresholds
    family: Thresholds


@dataclass(kw_only=True, frozen=True, slots=True)
class SequentialConfig:
    """The detector's fixed design (not the thresholds; those come from the false-alarm rate)."""

    reference: float = 1.0
    """CUSUM reference ``k`` (pooled-residual units): the test is tuned to shifts of ~2 k."""
    clip: float = 8.0
    """Residuals are clipped to [-clip, clip] before pooling."""
    trim: float = 0.25
    """Share of members cut at each end by the trimmed means."""
    limit_patience: int = 3
    """Consecutive values beyond the absolute limit (before a baseline) that fire an alarm."""
    name_members_above: float = 2.0
    """An alarm names the members (heads) whose residual is at least this (else the largest)."""
    shewhart: bool = False
    """Also alarm when one check's pooled residual lies beyond the test's Shewhart limit
    (``Thresholds.shewhart``; the union bound then splits each test's probability between the
    two, ``detect.null_model``). Off by default until held-out fault seeds confirm it."""
    trend: TrendConfig = field(default_factory=TrendConfig)
    """Per-stream baseline; ``family_trends`` overrides it per family."""
    family_trends: Mapping[str, TrendConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.reference) and self.reference > 0):
            raise ValueError(f"reference must be > 0, got {self.reference}.")
        if not (math.isfinite(self.clip) and self.clip > self.reference):
            raise ValueError(f"clip must be finite and > reference, got {self.clip}.")
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim}.")
        if self.limit_patience < 1:
            raise ValueError(f"limit_patience must be >= 1, got {self.limit_patience}.")

    def trend_of(self, family: str) -> TrendConfig:
        return self.family_trends.get(family, self.trend)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["family_trends"] = {k: asdict(v) for k, v in self.family_trends.items()}
        return out


WARMUP_STEPS = 200
"""Training steps of values that form a stream's first baseline (at least ``MIN_WARMUP_CHECKS``)."""
MIN_WARMUP_CHECKS = 5


def warmup_checks(interval: int) -> int:
    """Checks of warm-up for a check interval: ``max(5, ceil(200 / interval))`` (10 at interval 20,
    5 at interval 100). Measured in steps because the absolute routing-entropy limit judges the
    warm-up, and healthy routers of the study's model only sharpen below two effective experts
    after 680-960 steps (docs/RESULTS.md)."""
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}.")
    return max(MIN_WARMUP_CHECKS, math.ceil(WARMUP_STEPS / interval))


def default_sequential_config(interval: int) -> SequentialConfig:
    """The shipped design for a check interval (steps): baselines of the last 50 accepted checks
    (more when the warm-up is longer). Router weight similarity sits near 0, so its scale floor
    is absolute (0.005 cosine units)."""
    warmup = warmup_checks(interval)
    trend = TrendConfig(window=max(50, warmup), warmup=warmup, min_trend=warmup)
    return SequentialConfig(
        trend=trend,
        family_trends={ROUTER_WEIGHTS.name: replace(trend, abs_scale_floor=0.005)},
    )


@dataclass(frozen=True, slots=True)
class Observation:
    """One stream's value at one check."""

    family: str
    layer: int
    """Global 1-based layer number (megatron-core ``layer_number``)."""
    member: str
    """The stream within its layer: ``head_H`` (query-head index), ``dwq`` / ``dwk``, or ``""``."""
    value: float
    limit: Optional[float] = None
    """Absolute limit that stands in for the baseline while there is none (stream units)."""
    limit_reason: str = ""


@dataclass(frozen=True, slots=True)
class PooledAlarm:
    """A fired alarm: the detector's own result (the session turns it into its ``Alert`` record in
    one place, ``session/detector_setup.py: alert_of``)."""

    step: int
    family: str
    level: Level
    kind: AlarmKind
    layers: tuple[int, ...]
    """The layer of a layer-level alarm; for a family alarm the layers that carry it."""
    members: tuple[str, ...]
    """Heads (members) that carry it, in the first named layer."""
    statistic: float
    threshold: float
    change_step: Optional[int]
    """Check after which the shift began (the CUSUM's last zero); for an absolute-limit alarm the
    first check of the stream's present period without a baseline (since it started or was
    restarted after an alarm: the drift may predate the values' crossing, so the earliest step it
    can have begun is the start of that check's window); None if unknown."""
    reason: str = ""


@dataclass
class CheckResult:
    """What one check decided, plus the statistics worth writing as scalars."""

    step: int
    alarms: list[PooledAlarm] = field(default_factory=list)
    warnings: list[tuple[str, Optional[int]]] = field(default_factory=list)
    """(family, layer or None for the family test) above the warning level."""
    statistics: dict[str, float] = field(default_factory=dict)
    """``"<family>/cusum/layer_L"``, ``"<family>/residual/layer_L"``, ``"<family>/cusum"`` and,
    with the misfit counter on, ``"<family>/calibration_misfit"`` (1/0) and its
    ``.../observed`` and ``.../expected`` counts."""
    misfits: list[str] = field(default_factory=list)
    """Families whose calibration misfit fired at this check (once per family and job)."""
    young_residuals: dict[str, list[float]] = field(default_factory=dict)
    """Family -> the uncorrected residuals of its young baselines at this check (``phase_corrected``
    families; filled only by a detector built with ``collect_young``: what the phase moments are
    fitted on, ``calibrate/fit.py``)."""


@dataclass
class _Cusum:
    value: float = 0.0
    last_zero_step: Optional[int] = None

    def update(self, u: float, reference: float, previous_step: Optional[int]) -> None:
        if self.value <= 0.0:
            self.last_zero_step = previous_step
        self.value = max(0.0, self.value + u - reference)


def _stream_alarm(step: int, obs: Observation, kind: AlarmKind, statistic: float, threshold: float,
                  reason: str, change_step: Optional[int] = None) -> PooledAlarm:
    """A layer-level alarm raised by one stream alone (a non-finite value, the absolute limit)."""
    return PooledAlarm(
        step=step, family=obs.family, level="layer", kind=kind, layers=(obs.layer,), members=(obs.member,),
        statistic=statistic, threshold=threshold, change_step=change_step, reason=reason,
    )


class PooledCusumDetector:
    """See the module docstring. ``thresholds``: family -> :class:`FamilyThresholds`.

    ``warning_probability`` (the per-test, per-check null probability of the warning level that
    set the thresholds, ``detect.null_model``) turns on the calibration misfit counter
    (:mod:`~mechmon_megatron.detect.misfit`); None leaves it off. ``phase``: the phase moments that
    correct young baselines (``detect.phase_moments``); None judges them uncorrected.
    ``collect_young``: fill ``CheckResult.young_residuals`` (calibration replays)."""

    def __init__(
        self,
        thresholds: Mapping[str, FamilyThresholds],
        config: SequentialConfig,
        warning_probability: Optional[float] = None,
        phase: Optional[PhaseTable] = None,
        collect_young: bool = False,
    ) -> None:
        self.config = config
        self.phase = phase
        self.collect_young = collect_young
        self.thresholds = dict(thresholds)
        if config.shewhart:
            missing = sorted(f for f, t in self.thresholds.items() if t.layer.shewhart is None)
            if missing:
                raise ValueError(f"the Shewhart option needs Shewhart limits for families {missing}.")
        self.misfit = MisfitCounter(warning_probability) if warning_probability is not None else None
        self._trends: dict[tuple[str, int, str], RobustTrend] = {}
        self._limit_runs: dict[tuple[str, int, str], int] = {}
        self._layer_cusums: dict[tuple[str, int], _Cusum] = {}
        self._family_cusums: dict[str, _Cusum] = {}
        self._last_step: Optional[int] = None
        self._unbased_since: Optional[dict[tuple[str, int, str], int]] = {}
        """Stream -> first check of its present period without a baseline (from its first value, or
        its restart after an alarm); kept in the state; None: unknown (a state of an older release)."""
        self.first_alarm_steps: dict[str, int] = {}
        """Family -> step of its first alarm (any level)."""

    # ---------------------------------------------------------------- public
    def update(self, step: int, observations: Iterable[Observation]) -> CheckResult:
        """Judge one check; every observation of the check must be passed in one call."""
        result = CheckResult(step)
        by_family: dict[str, list[Observation]] = {}
        for obs in observations:
            if obs.family not in FAMILY_DIRECTIONS:
                raise ValueError(f"unknown detector family {obs.family!r}; known: {sorted(FAMILY_DIRECTIONS)}.")
            if obs.family not in self.thresholds:
                raise ValueError(f"no thresholds for detector family {obs.family!r}.")
            by_family.setdefault(obs.family, []).append(obs)
        for family in sorted(by_family):
            self._update_family(step, family, by_family[family], result)
        for alarm in result.alarms:
            self.first_alarm_steps.setdefault(alarm.family, step)
        self._last_step = step
        return result

    # ---------------------------------------------------------------- internals
    def _trend(self, key: tuple[str, int, str]) -> RobustTrend:
        trend = self._trends.get(key)
        if trend is None:
            trend = RobustTrend(self.config.trend_of(key[0]), FAMILY_DIRECTIONS[key[0]])
            self._trends[key] = trend
        return trend

    def _update_family(self, step: int, family: str, observations: list[Observation], result: CheckResult) -> None:
        cfg = self.config
        levels = self.thresholds[family]
        layers: dict[int, list[Observation]] = {}
        for obs in observations:
            layers.setdefault(obs.layer, []).append(obs)
        layer_u: dict[int, float] = {}
        residuals: dict[int, dict[str, float]] = {}
        to_accept: list[tuple[tuple[str, int, str], float]] = []
        restart_layers: set[int] = set()
        for layer in sorted(layers):
            zs: dict[str, float] = {}
            for obs in sorted(layers[layer], key=lambda o: o.member):
                key = (family, layer, obs.member)
                trend = self._trend(key)
                if not math.isfinite(obs.value):
                    reason = f"non-finite {family} value in layer {layer} {obs.member}".strip()
                    result.alarms.append(_stream_alarm(step, obs, "nonfinite", math.nan, math.nan, reason))
                    restart_layers.add(layer)
                    continue
                prediction = trend.predict()
                if self._unbased_since is not None:
                    self._unbased_since.setdefault(key, step)
                if prediction is None:
                    if obs.limit is not None and self._beyond(family, obs.value, obs.limit):
                        run = self._limit_runs.get(key, 0) + 1
                        self._limit_runs[key] = run
                        if run == cfg.limit_patience:
                            result.alarms.append(_stream_alarm(step, obs, "limit", obs.value, obs.limit,
                                                               obs.limit_reason, self._since(key)))
                        continue
                    self._limit_runs[key] = 0
                    to_accept.append((key, obs.value))
                    continue
                self._limit_runs[key] = 0
                z = trend.residual(obs.value, prediction)
                if trend.young and FAMILY_BY_NAME[family].phase_corrected:
                    if self.collect_young:
                        result.young_residuals.setdefault(family, []).append(z)
                    if self.phase is not None:
                        z = self.phase.standardise(family, step, z)
                z = max(-cfg.clip, min(cfg.clip, z))
                zs[obs.member] = z
                to_accept.append((key, obs.value))
            residuals[layer] = zs
            if zs:
                layer_u[layer] = trimmed_mean(zs.values(), cfg.trim)
        # Layer CUSUMs.
        upcrossings = 0  # tests crossing their warning level upwards at this check (misfit counter)
        for layer, u in layer_u.items():
            cusum = self._layer_cusums.setdefault((family, layer), _Cusum())
            before = cusum.value
            cusum.update(u, cfg.reference, self._last_step)
            upcrossings += before <= levels.layer.warning < cusum.value
            result.statistics[f"{family}/residual/layer_{layer}"] = u
            result.statistics[f"{family}/cusum/layer_{layer}"] = cusum.value
            cusum_fires = cusum.value > levels.layer.alarm
            if cusum_fires or self._shewhart_fires(u, levels.layer):
                # The CUSUM wins a tie: its last zero is the better change-point estimate.
                result.alarms.append(
                    PooledAlarm(
                        step=step,
                        family=family,
                        level="layer",
                        kind="cusum" if cusum_fires else "shewhart",
                        layers=(layer,),
                        members=self._carriers(residuals[layer]),
                        statistic=cusum.value if cusum_fires else u,
                        threshold=levels.layer.alarm if cusum_fires else float(levels.layer.shewhart or 0.0),
                        change_step=cusum.last_zero_step if cusum_fires else self._last_step,
                    )
                )
                restart_layers.add(layer)
            elif cusum.value > levels.layer.warning:
                result.warnings.append((family, layer))
        # Family CUSUM (only when there is more than one layer to pool).
        restart_family = False
        family_cusum = None
        if len(layer_u) > 1:
            family_cusum = self._family_cusums.setdefault(family, _Cusum())
            before = family_cusum.value
            u_family = trimmed_mean(layer_u.values(), cfg.trim)
            family_cusum.update(u_family, cfg.reference, self._last_step)
            upcrossings += before <= levels.family.warning < family_cusum.value
            result.statistics[f"{family}/cusum"] = family_cusum.value
            cusum_fires = family_cusum.value > levels.family.alarm
            if cusum_fires or self._shewhart_fires(u_family, levels.family):
                carriers = sorted(layer_u, key=lambda L: (-layer_u[L], L))
                named = tuple(L for L in carriers if layer_u[L] >= cfg.name_members_above) or tuple(carriers[:1])
                result.alarms.append(
                    PooledAlarm(
                        step=step,
                        family=family,
                        level="family",
                        kind="cusum" if cusum_fires else "shewhart",
                        layers=named,
                        members=self._carriers(residuals[named[0]]),
                        statistic=family_cusum.value if cusum_fires else u_family,
                        threshold=levels.family.alarm if cusum_fires else float(levels.family.shewhart or 0.0),
                        change_step=family_cusum.last_zero_step if cusum_fires else self._last_step,
                    )
                )
                restart_family = True
            elif family_cusum.value > levels.family.warning:
                result.warnings.append((family, None))
        if self.misfit is not None and layer_u:
            alarmed = family in self.first_alarm_steps or any(a.family == family for a in result.alarms)
            tests = len(layer_u) + (1 if len(layer_u) > 1 else 0)
            if not alarmed and self.misfit.count(family, tests, upcrossings):
                result.misfits.append(family)
            result.statistics.update(self.misfit.statistics(family))
        family_suspect = family_cusum is not None and family_cusum.value > levels.family.warning
        # Baselines: absorb the values of layers that are not suspected of a shift.
        for key, value in to_accept:
            layer_cusum = self._layer_cusums.get((family, key[1]))
            suspect = family_suspect or (layer_cusum is not None and layer_cusum.value > levels.layer.warning)
            if not suspect or not self._trend(key).ready:
                self._trend(key).accept(value)
        if restart_family:
            restart_layers.update(layers)
            self._family_cusums[family] = _Cusum()
        for layer in restart_layers:
            self._layer_cusums[(family, layer)] = _Cusum()
            for key, trend in self._trends.items():
                if key[0] == family and key[1] == layer:
                    trend.reset()
                    if self._unbased_since is not None:
                        self._unbased_since.pop(key, None)  # a new period begins at its next check

    def _since(self, key: tuple[str, int, str]) -> Optional[int]:
        return None if self._unbased_since is None else self._unbased_since.get(key)

    def _shewhart_fires(self, u: float, levels: Thresholds) -> bool:
        return self.config.shewhart and levels.shewhart is not None and u > levels.shewhart

    def _carriers(self, zs: Mapping[str, float]) -> tuple[str, ...]:
        ranked = sorted(zs, key=lambda m: (-zs[m], m))
        named = tuple(m for m in ranked if zs[m] >= self.config.name_members_above)
        return named or tuple(ranked[:1])

    @staticmethod
    def _beyond(family: str, value: float, limit: float) -> bool:
        return value < limit if FAMILY_DIRECTIONS[family] == "drop" else value > limit

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (thresholds and config are not saved: they come from flags)."""
        return {
            "version": POOLED_STATE_VERSION,
            "last_step": self._last_step,
            **({"unbased_since": [[*key, s] for key, s in sorted(self._unbased_since.items())]}
               if self._unbased_since is not None else {}),
            "trends": [[*key, t.state_dict()["values"]] for key, t in sorted(self._trends.items())],
            "limit_runs": [[*key, run] for key, run in sorted(self._limit_runs.items())],
            "layer_cusums": [[f, L, c.value, c.last_zero_step] for (f, L), c in sorted(self._layer_cusums.items())],
            "family_cusums": [[f, c.value, c.last_zero_step] for f, c in sorted(self._family_cusums.items())],
            "first_alarm_steps": dict(sorted(self.first_alarm_steps.items())),
            **({"misfit": self.misfit.state_dict()} if self.misfit is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != POOLED_STATE_VERSION:
            raise ValueError(
                f"pooled detector state version {state.get('version')!r} is not {POOLED_STATE_VERSION}; "
                "it was written by an incompatible mechmon-megatron."
            )
        trends: dict[tuple[str, int, str], RobustTrend] = {}
        for family, layer, member, values in state["trends"]:
            trend = RobustTrend(self.config.trend_of(family), FAMILY_DIRECTIONS[family])
            trend.load_state_dict({"values": values})
            trends[(family, int(layer), member)] = trend
        self._trends = trends
        self._limit_runs = {(f, int(L), m): int(r) for f, L, m, r in state["limit_runs"]}
        self._layer_cusums = {(f, int(L)): _Cusum(float(v), z) for f, L, v, z in state["layer_cusums"]}
        self._family_cusums = {f: _Cusum(float(v), z) for f, v, z in state["family_cusums"]}
        self._last_step = state["last_step"]
        since = state.get("unbased_since")  # a state of an older release has none: unknown
        self._unbased_since = None if since is None else {(f, int(L), m): int(s) for f, L, m, s in since}
        self.first_alarm_steps = {k: int(v) for k, v in state["first_alarm_steps"].items()}
        if self.misfit is not None and "misfit" in state:  # state of an older version has none: start at 0
            self.misfit.load_state_dict(state["misfit"])
