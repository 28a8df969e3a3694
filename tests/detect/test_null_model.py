"""Null-tail fit and the thresholds set from one false-alarm rate."""

import math
import random
import re

import pytest

from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.detect.null_model import (
    JobShape,
    NullTail,
    TailTable,
    fit_null_tail,
    load_tail_table,
    thresholds_for_job,
)


def test_exponential_samples_give_their_rate():
    rng = random.Random(1)
    tail = fit_null_tail([rng.expovariate(2.0) for _ in range(20000)], tail_quantile=0.9)
    assert tail.theta_hat == pytest.approx(2.0, rel=0.08)
    assert tail.theta < tail.theta_hat  # lower confidence bound
    assert tail.log_p_u0 == pytest.approx(math.log(0.1), abs=0.02)


def test_cusum_of_gaussian_increments_has_the_lundberg_tail():
    """S = max(0, S + x - k), x ~ N(0, 1): P(S > h) decays as exp(-2 k h) (Cramer-Lundberg)."""
    rng = random.Random(2)
    k, s, values = 1.0, 0.0, []
    for _ in range(300000):
        s = max(0.0, s + rng.gauss(0.0, 1.0) - k)
        values.append(s)
    tail = fit_null_tail(values, tail_quantile=0.99)
    assert tail.theta_hat == pytest.approx(2 * k, rel=0.15)


def test_too_few_exceedances_is_an_error():
    with pytest.raises(ValueError, match="longer healthy runs"):
        fit_null_tail([0.0] * 1000 + [1.0, 2.0])


def test_threshold_inverts_the_tail():
    tail = NullTail(u0=1.0, log_p_u0=math.log(0.05), theta=0.5, theta_hat=0.6, samples=1000, exceedances=50)
    h = tail.threshold(1e-8)
    assert h == pytest.approx(1.0 + (math.log(0.05) - math.log(1e-8)) / 0.5)
    assert math.exp(tail.log_survival(h)) == pytest.approx(1e-8)
    assert tail.threshold(0.5) == 1.0  # never below u0


def _table(theta=1.0):
    t = NullTail(u0=0.0, log_p_u0=math.log(0.1), theta=theta, theta_hat=theta, samples=100, exceedances=10)
    fams = {f: {"layer": t, "family": t} for f in ("attn_delta2", "attn_dw", "router_entropy", "router_weights")}
    return TailTable(
        tails={1: fams, 5: {f: {"layer": NullTail(0.0, math.log(0.1), theta / 5, theta / 5, 100, 10)} for f in fams}}
    )


def test_union_bound_over_tests_and_checks():
    shape = JobShape(layers={"attn_delta2": 4, "attn_dw": 4, "router_entropy": 4, "router_weights": 1}, interval=20)
    assert shape.num_tests() == 5 + 5 + 5 + 1
    thresholds, account = thresholds_for_job(shape, rate_per_million=0.01, table=_table())
    p = 0.01 / (16 * 50000)
    assert account.per_test_check_probability == pytest.approx(p)
    assert thresholds["attn_delta2"].layer.alarm == pytest.approx(math.log(0.1) - math.log(p))
    assert thresholds["attn_delta2"].layer.warning < thresholds["attn_delta2"].layer.alarm
    # expected false alarms under the fitted tails = the rate asked for
    expected = sum(
        shape.checks_per_million()
        * math.exp(_table().tails[1][f]["layer"].log_survival(getattr(thresholds[f], lv).alarm))
        for f, n in shape.layers.items()
        for lv in (["layer"] * n + (["family"] if n > 1 else []))
    )
    assert expected == pytest.approx(0.01, rel=1e-6)


def test_overlap_lookup_is_conservative_and_extrapolation_is_noted():
    table = _table()
    tail, note = table.tail(3, "attn_dw", "layer")
    assert tail.theta == pytest.approx(0.2) and "overlap 5" in note
    tail, note = table.tail(10, "attn_dw", "family")  # family falls back to layer at overlap 5
    assert tail.theta == pytest.approx(0.1) and "extrapolation" in note
    assert table.tail(1, "attn_dw", "layer") == (table.tails[1]["attn_dw"]["layer"], "")


@pytest.mark.parametrize("rate, reason", [(0.0, r"must be a number > 0, got 0\.0"), (math.nan, "must be a number > 0"),
                                          (1e9, r"1e\+09 asks each of the job's 3 tests")])
def test_bad_rate_names_the_setting_and_no_flag(rate, reason):
    with pytest.raises(ConfigError) as info:
        thresholds_for_job(JobShape(layers={"attn_dw": 2}, interval=100), rate_per_million=rate, table=_table())
    assert info.value.field == "false_alarm_rate" and re.match(reason, info.value.reason)
    assert "--mechmon" not in str(info.value)  # the core names the field; each front end spells it


def test_thresholds_are_defined_for_every_probability_even_when_theta_underflows():
    """Beyond the measured overlaps theta is scaled down; a tiny one reaches 0.0: no finite threshold
    gives the probability, and the threshold is infinite instead of a ZeroDivisionError; ``bounded``
    says so before any job's thresholds are set."""
    tail = NullTail(u0=1.0, log_p_u0=math.log(0.1), theta=5e-324, theta_hat=1.0, samples=100, exceedances=10)
    table = TailTable(tails={1: {"attn_dw": {"layer": tail}}})
    scaled, note = table.tail(10, "attn_dw", "layer")
    assert scaled.theta == 0.0 and "extrapolation" in note
    assert scaled.threshold(1e-6) == math.inf and scaled.threshold(0.5) == 1.0
    assert not scaled.bounded() and not tail.bounded()  # what the start-up check refuses (detector_setup)
    assert all(t.bounded() for fams in load_tail_table().tails.values() for levels in fams.values()
               for t in levels.values())


def test_table_round_trip_and_shipped_table_loads():
    table = _table()
    assert TailTable.from_dict(table.to_dict()).tails == table.tails
    shipped = load_tail_table()
    assert {1, 5} <= set(shipped.tails)
    for overlap in shipped.tails.values():
        assert set(overlap) == {"attn_delta2", "attn_dw", "router_entropy", "router_weights"}


def test_the_shewhart_section_gets_the_same_checks_as_the_tails():
    import copy
    import json
    import os

    import mechmon_megatron.detect as detect
    from mechmon_megatron.detect.null_model import TailTable

    with open(os.path.join(os.path.dirname(detect.__file__), "null_tails.json")) as f:
        shipped = json.load(f)
    assert TailTable.from_dict(shipped).shewhart  # the shipped table has the section, and it passes
    bad = copy.deepcopy(shipped)
    bad["shewhart"]["5"]["attn_delta2"]["layer"]["theta"] = 0
    with pytest.raises(ValueError, match=r"shewhart\['5'\]\['attn_delta2'\]\['layer'\]"):
        TailTable.from_dict(bad)
    with pytest.raises(ValueError, match='"shewhart" must be an object'):
        TailTable.from_dict({**shipped, "shewhart": [1, 2]})
    assert not TailTable.from_dict({"tails": shipped["tails"]}).shewhart  # an old file without it loads
