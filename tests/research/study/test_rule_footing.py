"""The max-logit rule on equal footing, on the committed short-window records: the threshold lies
beyond every healthy maximum it was fitted on, and a higher threshold never alarms earlier."""

from __future__ import annotations

import os

import pytest

from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.rule_footing import equal_footing, healthy_maxima
from mechmon_megatron.research.study.shipped_replay import LOGIT_RULE, logit_rule_first, logit_rule_threshold

RECORDS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "data", "short_window_study")


@pytest.fixture(scope="module")
def records():
    if not os.path.isdir(RECORDS):
        pytest.skip("docs/data/short_window_study not present")
    return load_records(RECORDS)


def test_only_whole_healthy_runs_count_and_the_threshold_is_beyond_them(records):
    maxima = healthy_maxima(records, LOGIT_RULE, 10_000)
    assert set(maxima) == {f"healthy-cosine-seed{s}" for s in (1, 2, 10, 11, 12)}  # prefixes and faults left out
    footing = equal_footing(records, LOGIT_RULE, 0.01, 10_000)
    assert footing.threshold > max(maxima.values())
    assert footing.per_run_probability == pytest.approx(1e-4)
    quiet = logit_rule_threshold(records)
    assert quiet is not None and quiet <= footing.threshold
    for run_id in ("fa-s32-on500-seed1", "fa-s16-on500-seed2"):
        early, late = logit_rule_first(records[run_id], quiet), logit_rule_first(records[run_id], footing.threshold)
        assert early is not None and (late is None or late >= early)


def test_too_few_healthy_runs_are_refused(records):
    with pytest.raises(ValueError, match="a tail model needs 3"):
        equal_footing(records, LOGIT_RULE, 0.01, 1_900 + 1)
