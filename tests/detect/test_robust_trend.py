"""RobustTrend against brute-force medians and exact lines."""

import statistics

import pytest

from mechmon_megatron.detect.robust_trend import RobustTrend, TrendConfig


def _trend(values, direction="drop", **kw):
    t = RobustTrend(TrendConfig(**kw), direction)
    for v in values:
        t.accept(v)
    return t


def test_not_ready_before_warmup():
    t = _trend([1.0] * 9, warmup=10, min_trend=10)
    assert not t.ready and t.predict() is None
    t.accept(1.0)
    assert t.ready and t.predict() is not None


def test_flat_baseline_is_median_and_mad():
    values = [3.0, 1.0, 2.0, 5.0, 4.0, 2.5, 3.5, 1.5, 4.5, 0.5]
    p = _trend(values, warmup=5, min_trend=20).predict()
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    assert p.center == pytest.approx(med)
    assert p.scale == pytest.approx(1.4826 * mad)
    assert p.slope == 0.0


def test_falling_line_is_extrapolated_for_a_drop_stream():
    line = [10.0 - 0.5 * i for i in range(30)]
    t = _trend(line, "drop", warmup=10, min_trend=10)
    p = t.predict()
    assert p.center == pytest.approx(10.0 - 0.5 * 30)
    assert p.slope == pytest.approx(-0.5)
    assert t.residual(10.0 - 0.5 * 30 - 1.0, p) == pytest.approx(1.0 / p.scale)


def test_rising_line_is_not_extrapolated_for_a_drop_stream():
    line = [0.5 * i for i in range(30)]
    p = _trend(line, "drop", warmup=10, min_trend=10).predict()
    assert p.slope == 0.0
    assert p.center == pytest.approx(statistics.median(line[15:]))


def test_rising_line_is_extrapolated_for_a_rise_stream_and_damped():
    line = [0.5 * i for i in range(30)]
    p = _trend(line, "rise", warmup=10, min_trend=10).predict()
    assert p.center == pytest.approx(15.0)
    damped = _trend(line, "rise", warmup=10, min_trend=10, slope_damping=0.5).predict()
    assert statistics.median(line[15:]) < damped.center < p.center


def test_scale_floors():
    p = _trend([2.0] * 12, warmup=10).predict()
    assert p.scale == pytest.approx(0.002 * 2.0)
    q = _trend([0.0] * 12, warmup=10, abs_scale_floor=0.005).predict()
    assert q.scale == pytest.approx(0.005)


def test_residual_sign_follows_direction():
    drop, rise = _trend([1.0] * 10, "drop", warmup=10), _trend([1.0] * 10, "rise", warmup=10)
    assert drop.residual(0.9, drop.predict()) > 0 > drop.residual(1.1, drop.predict())
    assert rise.residual(1.1, rise.predict()) > 0 > rise.residual(0.9, rise.predict())


def test_window_and_state_round_trip():
    t = _trend([float(i) for i in range(80)], window=50, warmup=10)
    assert len(t.values) == 50 and t.values[0] == 30.0
    u = RobustTrend(t.config, "drop")
    u.load_state_dict(t.state_dict())
    assert u.predict() == t.predict()


def test_non_finite_values_are_not_accepted():
    t = _trend([1.0, float("nan"), float("inf")])
    assert list(t.values) == [1.0]


@pytest.mark.parametrize(
    "kw",
    [
        dict(window=3),
        dict(warmup=0),
        dict(warmup=60),
        dict(slope_damping=1.5),
        dict(rel_scale_floor=-1.0),
        dict(min_trend=True),
    ],
)
def test_bad_config(kw):
    with pytest.raises(ValueError):
        TrendConfig(**kw)
