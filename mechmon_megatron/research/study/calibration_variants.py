"""Two variants of the null-tail fit, judged by the leave-one-run-out check (issue 19, item 2's
"a tail model that the leave-one-out check does not reject"; research, not in the product).

The shipped fit (``null_model.fit_null_tail``) treats every CUSUM value above ``u0`` as an
independent exponential excess and bounds theta from below with chi2(2k). Two ways it could be
too light, each with the variant that removes it:

- ``declustered``: consecutive CUSUM values of one test are one excursion, not independent draws,
  so the confidence bound is computed with k_eff = the number of clusters (maximal runs of
  consecutive values above ``u0`` in each test's series) instead of the k exceedances. The point
  estimate and ``P(S > u0)`` are unchanged; only the bound widens.
- ``warning-freeze``: the tails are fitted on values replayed with thresholds at infinity, but
  the live detector stops a stream's baseline from absorbing while a test is above its warning
  level, so an excursion past the warning runs further than in the fitted values. This variant
  refits on values replayed WITH the warning levels of the previous fit in force (alarm levels at
  infinity), ``iterations`` times, starting from the shipped fit: a fit consistent with the
  detector that uses it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mechmon_megatron.detect.null_model import (
    DEFAULT_FALSE_ALARM_RATE,
    NullTail,
    TailTable,
    _chi2_quantile,
    fit_null_tail,
)
from mechmon_megatron.detect.pooled_cusum import FamilyThresholds, Thresholds, default_sequential_config
from mechmon_megatron.research.study.calibration_check import (
    TAIL_QUANTILE,
    FoldFit,
    HeldOutRun,
    leave_one_run_out,
    pool_statistics,
    shipped_fold_fit,
)
from mechmon_megatron.research.study.pooled_replay import (
    FAMILIES,
    Checks,
    fit_levels,
    replay_pooled,
    thresholds_at_rate,
)

VARIANTS = ("shipped", "declustered", "warning-freeze")
_NEVER = 1e12


def clusters_above(values: Sequence[float], u0: float) -> int:
    """Maximal runs of consecutive values above ``u0`` (non-finite values end a run)."""
    count, inside = 0, False
    for v in values:
        above = math.isfinite(v) and v > u0
        count += above and not inside
        inside = above
    return count


def fit_declustered_tail(values: Iterable[float], tail_quantile: float = 0.95, confidence: float = 0.95,
                         min_exceedances: int = 20, hard_min_exceedances: int = 5) -> NullTail:
    """``fit_null_tail`` with theta's lower bound from chi2(2 k_eff), k_eff = :func:`clusters_above`
    of ``values`` in their recorded order (one test's series after another)."""
    ordered = [float(v) for v in values]
    tail = fit_null_tail(ordered, tail_quantile=tail_quantile, confidence=confidence,
                         min_exceedances=min_exceedances, hard_min_exceedances=hard_min_exceedances)
    k_eff = max(1, clusters_above(ordered, tail.u0))
    theta_low = tail.theta_hat * _chi2_quantile(1.0 - confidence, 2 * k_eff) / (2 * k_eff)
    return NullTail(u0=tail.u0, log_p_u0=tail.log_p_u0, theta=theta_low, theta_hat=tail.theta_hat,
                    samples=tail.samples, exceedances=tail.exceedances)


def declustered_fold_fit(runs: Sequence[Checks], stats: Sequence[Mapping[str, Mapping[str, list[float]]]],
                         interval: int, overlap: int) -> dict[str, dict[str, NullTail]]:
    tails, _ = fit_levels(pool_statistics(stats), overlap, TAIL_QUANTILE, "CUSUM", fit=fit_declustered_tail)
    return tails


def statistics_under_warnings(checks: Checks, thresholds: Mapping[str, FamilyThresholds],
                              interval: int) -> dict[str, dict[str, list[float]]]:
    """CUSUM values of every test, by family and level, replayed with ``thresholds``' warning levels
    in force and no alarm (as ``pooled_replay.null_statistics`` does with none)."""
    warning_only = {f: FamilyThresholds(layer=Thresholds(warning=t.layer.warning, alarm=_NEVER),
                                        family=Thresholds(warning=t.family.warning, alarm=_NEVER))
                    for f, t in thresholds.items()}
    out: dict[str, dict[str, list[float]]] = {f: {"layer": [], "family": []} for f in FAMILIES}
    replay = replay_pooled(checks, warning_only, default_sequential_config(interval))
    for key, series in replay.statistics.items():
        family = key.split("/", 1)[0]
        out[family]["layer" if "/layer_" in key else "family"].extend(v for _, v in series)
    return out


def warning_freeze_fold_fit(iterations: int = 2, rate: float = DEFAULT_FALSE_ALARM_RATE) -> FoldFit:
    """The fold fit of the ``warning-freeze`` variant (``iterations`` refits after the shipped one)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")

    def fold_fit(runs: Sequence[Checks], stats: Sequence[Mapping[str, Mapping[str, list[float]]]],
                 interval: int, overlap: int) -> dict[str, dict[str, NullTail]]:
        tails = shipped_fold_fit(runs, stats, interval, overlap)
        for _ in range(iterations):
            table = TailTable(tails={overlap: tails})
            frozen = [statistics_under_warnings(c, thresholds_at_rate(c, interval, overlap, rate, table)[0], interval)
                      for c in runs]
            tails, _ = fit_levels(pool_statistics(frozen), overlap, TAIL_QUANTILE, "CUSUM")
        return tails

    return fold_fit


def compare_variants(series: Sequence[Checks], names: Sequence[str], interval: int, delta: int,
                     rate: float = DEFAULT_FALSE_ALARM_RATE, variants: Sequence[str] = VARIANTS,
                     iterations: int = 2) -> dict[str, list[HeldOutRun]]:
    """``leave_one_run_out`` under each variant of the fit, by variant name."""
    fits: dict[str, FoldFit] = {"shipped": shipped_fold_fit, "declustered": declustered_fold_fit,
                                "warning-freeze": warning_freeze_fold_fit(iterations, rate)}
    unknown = [v for v in variants if v not in fits]
    if unknown:
        raise ValueError(f"unknown tail-fit variants {unknown}; choose from {list(VARIANTS)}")
    return {v: leave_one_run_out(series, names, interval, delta, rate, fold_fit=fits[v]) for v in variants}


def markdown(results: Mapping[str, Sequence[HeldOutRun]]) -> str:
    """One row per variant and schedule: held-out runs with an alarm (what fired, where)."""
    lines = ["| tail fit | interval | held-out runs | with a false alarm | alarms (run: step family level S > level) |",
             "|---|---|---|---|---|"]
    for variant, held in results.items():
        by_interval: dict[int, list[HeldOutRun]] = {}
        for h in held:
            by_interval.setdefault(h.interval, []).append(h)
        for interval, runs in sorted(by_interval.items()):
            fired = [h for h in runs if h.alarms]
            shown = "; ".join(f"{h.run}: {a['step']} {a['family']} {a['level']} {a['statistic']:.1f} > "
                              f"{a['threshold']:.1f}" for h in fired for a in h.alarms[:1])
            lines.append(f"| {variant} | {interval} | {len(runs)} | {len(fired)} | {shown or '-'} |")
    return "\n".join(lines) + "\n"


def as_json(results: Mapping[str, Sequence[HeldOutRun]]) -> dict[str, Any]:
    return {v: [{"run": h.run, "interval": h.interval, "alarms": list(h.alarms)} for h in held]
            for v, held in results.items()}
