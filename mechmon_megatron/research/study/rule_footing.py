"""A symptom rule beside the detector on equal footing (docs/METHOD.md section 8c): the rule's
threshold set from the healthy runs of a set of records by the detector's procedure
(:mod:`~mechmon_megatron.research.study.rule_calibration`: a tail model of the per-run maxima that
leave-one-run-out does not reject, extrapolated to the detector's false-alarm rate per run).

The rule's first alarm after a fault's onset at a threshold is
``shipped_replay.logit_rule_first``; its most sensitive healthy-quiet threshold (the unequal
second row) is ``shipped_replay.logit_rule_threshold``. Needs numpy (the rule scores).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from mechmon_megatron.research.study import rule_scores
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.rule_calibration import RuleCalibration, calibrate_rule, per_run_probability

__all__ = ["equal_footing", "healthy_maxima"]


def healthy_maxima(records: Mapping[str, CampaignRecord], rule: str, run_steps: int) -> dict[str, float]:
    """Run id -> the largest finite score of ``rule`` on each healthy record of exactly
    ``run_steps`` steps (maxima of runs of one length share one law)."""
    out = {}
    for run_id, record in sorted(records.items()):
        d = record.data
        if not record.healthy or not d.steps or d.steps[-1] != run_steps:
            continue
        series = rule_scores.rule_scores(d.steps, d.loss, d.grad_norm, d.max_attn_logit, {}).get(rule)
        if series is None:
            continue
        finite = series.scores[np.isfinite(series.scores)]
        if len(finite):
            out[run_id] = float(finite.max())
    return out


def equal_footing(records: Mapping[str, CampaignRecord], rule: str, rate_per_million_steps: float,
                  run_steps: int) -> RuleCalibration:
    """The rule's threshold at the detector's ``R`` false alarms per 10^6 steps, from the healthy
    records of ``run_steps`` steps; ``ValueError`` when fewer than 3 such records have the rule."""
    maxima = healthy_maxima(records, rule, run_steps)
    if len(maxima) < 3:
        raise ValueError(f"{rule}: {len(maxima)} healthy records of {run_steps} steps, a tail model needs 3")
    p = per_run_probability(rate_per_million_steps, run_steps)
    if not 0 < p < 1 or not math.isfinite(p):
        raise ValueError(f"per-run false-alarm probability {p} is not in (0, 1)")
    return calibrate_rule(list(maxima.values()), p)
