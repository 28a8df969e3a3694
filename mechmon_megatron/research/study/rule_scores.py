"""Symptom rules as score series, so each one can be swept over its threshold in one pass.

Every rule of the comparison alarms when a per-step (or per-check) score reaches its threshold:

=====================  ============================================  ====================
rule                   score at step t                                alarm when
=====================  ============================================  ====================
``loss_6sigma``        (x_t - mean) / std of the previous 128 losses  score > n_sigma (6)
``loss_10x``           x_t / max of the first 100 losses              score >= factor (10)
``loss_2x_mean``       min over the last 5 steps of x / mean of the   score >= factor (2)
                       previous 100 (the llm-foundry rule: > 4 steps)
``grad_norm_6sigma``   the ``loss_6sigma`` score of the grad norm      score > n_sigma (6)
``max_attn_logit``     x_t / median of its first 100 steps from 200   score >= factor (3)
``wq_spectral_norm``   max over layers of x / median of the layer's   score >= factor (3)
                       first 10 checks from step 200
=====================  ============================================  ====================

At their published defaults (in brackets) the scores reproduce the rules of
``mechmon_megatron.research.baselines.symptom_rules`` step for step (tested). A non-finite value
scores +inf. An alarm *episode* is a maximal run of consecutive alarming steps; false-alarm
rates count episodes. Needs numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["RULE_GRIDS", "ScoreSeries", "first_alarm", "episodes", "rule_scores"]

RULE_GRIDS: dict[str, tuple[float, ...]] = {
    "loss_6sigma": (3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 30.0),
    "loss_10x": (1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0, 10.0),
    "loss_2x_mean": (1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0),
    "grad_norm_6sigma": (3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 30.0),
    "max_attn_logit": (1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 8.0),
    "wq_spectral_norm": (1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 8.0),
}
"""Thresholds swept per rule (the published default is in each grid)."""

STRICT_RULES = ("loss_6sigma", "grad_norm_6sigma")
"""Rules that alarm on ``score > threshold`` (the others on ``>=``)."""


@dataclass
class ScoreSeries:
    steps: np.ndarray
    scores: np.ndarray
    strict: bool


def _rolling_sigma_score(x: np.ndarray, window: int) -> np.ndarray:
    """(x_t - mean) / std (ddof 1) of the previous ``window`` finite values; NaN before a full window.
    Non-finite values score +inf and stay out of the window, as in ``OlmoSpikeRule``."""
    out = np.full(len(x), np.nan)
    history: list[float] = []
    s = s2 = 0.0
    for i, v in enumerate(x):
        if not math.isfinite(v):
            out[i] = math.inf
            continue
        if len(history) >= window:
            n = len(history)
            mean = s / n
            var = max(0.0, (s2 - n * mean * mean) / (n - 1))
            std = math.sqrt(var)
            out[i] = (v - mean) / std if std > 0 else (math.inf if v > mean else -math.inf)
        history.append(v)
        s += v
        s2 += v * v
        if len(history) > window:
            old = history.pop(0)
            s -= old
            s2 -= old * old
    return out


def _first_n_reference(x: np.ndarray, n: int, reduce) -> tuple[Optional[float], int]:
    """Reference from the first ``n`` finite values; returns (reference, index after them)."""
    seen: list[float] = []
    for i, v in enumerate(x):
        if math.isfinite(v):
            seen.append(float(v))
            if len(seen) == n:
                return float(reduce(seen)), i + 1
    return None, len(x)


def _ratio_to_reference(x: np.ndarray, n: int, reduce, abs_values: bool = False) -> np.ndarray:
    vals = np.abs(x) if abs_values else x
    ref, start = _first_n_reference(vals, n, reduce)
    out = np.full(len(x), np.nan)
    if ref is None:
        return out
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = vals[start:] / ref if ref != 0 else np.where(vals[start:] > 0, np.inf, np.nan)
    ratio = np.where(np.isfinite(vals[start:]), ratio, np.inf)
    if not abs_values:  # growth rules also need value > reference
        ratio = np.where(np.isfinite(vals[start:]) & (vals[start:] <= ref), np.minimum(ratio, 1.0), ratio)
    out[start:] = ratio
    return out


def _foundry_score(x: np.ndarray, window: int = 100, patience: int = 4) -> np.ndarray:
    """min over the last ``patience + 1`` judged steps of x / mean(previous ``window``)."""
    ratio = np.full(len(x), np.nan)
    history: list[float] = []
    s = 0.0
    for i, v in enumerate(x):
        if not math.isfinite(v):
            ratio[i] = math.inf
            continue
        if len(history) >= window:
            mean = s / len(history)
            ratio[i] = v / mean if mean != 0 else (math.inf if v > 0 else -math.inf)
        history.append(v)
        s += v
        if len(history) > window:
            s -= history.pop(0)
    out = np.full(len(x), np.nan)
    run: list[float] = []
    for i, r in enumerate(ratio):
        if math.isinf(r) and r > 0 and not math.isfinite(x[i]):
            out[i] = math.inf  # non-finite: alarm, run unchanged
            continue
        if math.isnan(r):
            continue
        run.append(r)
        if len(run) > patience + 1:
            run.pop(0)
        if len(run) == patience + 1:
            out[i] = min(run)
    return out


def rule_scores(steps: Sequence[int], loss: Sequence[float], grad_norm: Sequence[float],
                max_attn_logit: Sequence[float], wq_checks: dict[str, tuple[list[int], list[float]]],
                start_step: int = 200) -> dict[str, ScoreSeries]:
    """Score series of every symptom rule for one run (``wq_checks``: layer -> (steps, values))."""
    st = np.asarray(steps, dtype=np.int64)
    lo = np.asarray(loss, dtype=float)
    gn = np.asarray(grad_norm, dtype=float)
    ml = np.asarray(max_attn_logit, dtype=float)
    out = {
        "loss_6sigma": ScoreSeries(st, _rolling_sigma_score(lo, 128), True),
        "loss_10x": ScoreSeries(st, _ratio_to_reference(lo, 100, max, abs_values=True), False),
        "loss_2x_mean": ScoreSeries(st, _foundry_score(lo), False),
        "grad_norm_6sigma": ScoreSeries(st, _rolling_sigma_score(gn, 128), True),
    }
    late = st >= start_step
    if np.any(np.isfinite(ml)):
        scores = np.full(len(st), np.nan)
        scores[late] = _ratio_to_reference(ml[late], 100, np.median)
        out["max_attn_logit"] = ScoreSeries(st, scores, False)
    if wq_checks:
        check_steps = sorted({s for ss, _ in wq_checks.values() for s in ss if s >= start_step})
        index = {s: i for i, s in enumerate(check_steps)}
        best = np.full(len(check_steps), np.nan)
        for layer_steps, values in wq_checks.values():
            pairs = [(s, v) for s, v in zip(layer_steps, values) if s >= start_step]
            if not pairs:
                continue
            ratio = _ratio_to_reference(np.asarray([v for _, v in pairs], dtype=float), 10, np.median)
            for (s, _), r in zip(pairs, ratio):
                if not math.isnan(r):
                    best[index[s]] = r if math.isnan(best[index[s]]) else max(best[index[s]], r)
        out["wq_spectral_norm"] = ScoreSeries(np.asarray(check_steps, dtype=np.int64), best, False)
    return out


def _alarming(series: ScoreSeries, threshold: float) -> np.ndarray:
    s = np.nan_to_num(series.scores, nan=-np.inf)
    return s > threshold if series.strict else s >= threshold


def first_alarm(series: ScoreSeries, threshold: float, from_step: int = 0) -> Optional[int]:
    """First step at or after ``from_step`` whose score alarms at ``threshold``."""
    hits = np.nonzero(_alarming(series, threshold) & (series.steps >= from_step))[0]
    return int(series.steps[hits[0]]) if len(hits) else None


def episodes(series: ScoreSeries, threshold: float, until_step: Optional[int] = None) -> list[int]:
    """Start steps of the alarm episodes (maximal runs of alarming entries)."""
    alarm = _alarming(series, threshold)
    if until_step is not None:
        alarm &= series.steps <= until_step
    starts = np.nonzero(alarm & ~np.concatenate(([False], alarm[:-1])))[0]
    return [int(series.steps[i]) for i in starts]
