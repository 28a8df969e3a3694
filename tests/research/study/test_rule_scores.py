"""The score form of every symptom rule reproduces the rule objects at their published defaults."""

import math
import random

import numpy as np
import pytest

from mechmon_megatron.research.baselines.symptom_rules import (
    FoundrySpikeRule,
    GrowthRule,
    MegatronSpikeRule,
    OlmoSpikeRule,
)
from mechmon_megatron.research.study import rule_scores


def _series(seed, n=700):
    rng = random.Random(seed)
    x, out = 3.0, []
    for i in range(n):
        x = max(0.5, x + rng.gauss(-0.001, 0.03))
        v = x * (rng.choice([1.0] * 40 + [2.5, 12.0]))
        out.append(float("nan") if i == 450 else v)
    return out


def _alarm_steps(rule, steps, values):
    return [s for s, v in zip(steps, values) if rule.update(s, v)]


def _score_alarm_steps(series, threshold):
    s = np.nan_to_num(series.scores, nan=-np.inf)
    hit = s > threshold if series.strict else s >= threshold
    return [int(t) for t, h in zip(series.steps, hit) if h]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scores_reproduce_the_rules(seed):
    values = _series(seed)
    steps = list(range(1, len(values) + 1))
    scores = rule_scores.rule_scores(steps, values, values, values, {}, start_step=200)
    assert _score_alarm_steps(scores["loss_6sigma"], 6.0) == _alarm_steps(OlmoSpikeRule(), steps, values)
    assert _score_alarm_steps(scores["loss_10x"], 10.0) == _alarm_steps(MegatronSpikeRule(), steps, values)
    assert _score_alarm_steps(scores["loss_2x_mean"], 2.0) == _alarm_steps(FoundrySpikeRule(), steps, values)
    late = [(s, v) for s, v in zip(steps, values) if s >= 200]
    growth = _alarm_steps(GrowthRule(reference_steps=100, factor=3.0), [s for s, _ in late], [v for _, v in late])
    assert _score_alarm_steps(scores["max_attn_logit"], 3.0) == growth
    assert _score_alarm_steps(scores["loss_6sigma"], 6.0)  # the series does spike


def test_wq_score_is_the_max_over_layers_of_the_growth_ratio():
    steps = list(range(200, 600, 20))
    layer_a = [1.0] * 10 + [1.0 + 0.5 * i for i in range(10)]
    layer_b = [2.0] * 20
    scores = rule_scores.rule_scores([1], [1.0], [1.0], [float("nan")], {"a": (steps, layer_a), "b": (steps, layer_b)})
    wq = scores["wq_spectral_norm"]
    rule = GrowthRule(reference_steps=10, factor=3.0)
    expected = [s for s, v in zip(steps, layer_a) if rule.update(s, v)]
    assert _score_alarm_steps(wq, 3.0) == expected
    assert "max_attn_logit" not in scores  # no logit recorded


def test_first_alarm_and_episodes():
    series = rule_scores.ScoreSeries(np.arange(1, 11), np.array([0, 5, 5, 0, 0, 7, 0, 5, 5, 5], float), strict=False)
    assert rule_scores.first_alarm(series, 5.0) == 2
    assert rule_scores.first_alarm(series, 5.0, from_step=4) == 6
    assert rule_scores.first_alarm(series, 8.0) is None
    assert rule_scores.episodes(series, 5.0) == [2, 6, 8]
    assert rule_scores.episodes(series, 5.0, until_step=7) == [2, 6]
    assert math.isinf(
        rule_scores.rule_scores([1, 2], [1.0, float("inf")], [1.0, 1.0], [1.0, 1.0], {})["loss_6sigma"].scores[1]
    )
