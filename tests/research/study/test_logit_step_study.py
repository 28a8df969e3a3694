"""The per-step logit growth test of the round-6 study (research/study/logit_step_study.py)."""

import math
import random

from mechmon_megatron.detect.pooled_cusum import FamilyThresholds, Thresholds
from mechmon_megatron.research.study.logit_step_study import group_of, replay_logit


def _series(jump_at=None, factor=3.0, steps=2000, seed=0):
    rng = random.Random(seed)
    out = []
    for step in range(1, steps + 1):
        x = 25.0 * math.exp(rng.gauss(0.0, 0.08))
        if jump_at is not None and step >= jump_at:
            x *= factor
        out.append((step, math.log(x)))
    return out


LEVELS = FamilyThresholds(Thresholds(warning=24.0, alarm=37.0), Thresholds(warning=24.0, alarm=37.0))


def test_quiet_on_a_stationary_stream_and_fast_on_a_jump():
    first, alarms, cusums = replay_logit(_series(), LEVELS)
    assert first is None and alarms == []
    assert len(cusums) == 2000 - 200  # no CUSUM during the 200-step warm-up
    first, _, _ = replay_logit(_series(jump_at=1500), LEVELS, start_step=1500)
    # Clipped residuals (8) and reference 1 add at most 7 per step: >= 6 steps to pass 37.
    assert first is not None and 1505 <= first <= 1515


def test_a_falling_logit_never_alarms():
    first, alarms, _ = replay_logit(_series(jump_at=1500, factor=0.3), LEVELS)
    assert first is None and alarms == []


def test_groups():
    assert group_of("fa-s32-on500-seed2") == "choice"
    assert group_of("fa-s16-on2000-seed5") == "held-out 4-6"
    assert group_of("fa-s32-on500-seed9") == "held-out 7-9"
    assert group_of("moe-lr-seed1") == "lr"
