"""The per-stream rule of mechmon 0.1 (research/detect_v01): band, patience, re-arm, state, the bank."""

import dataclasses
import json
import math
import random

import pytest

from mechmon_megatron.research.detect_v01 import (
    BaselineRelativeDetector,
    DetectorBank,
    DetectorConfig,
    DetectorEvent,
    default_detector_configs,
)

SEEDS = range(6)
CENTERS = ["median", "ema"]


def _feed(det, values, start_step=0, stride=10):
    """Checks every ``stride`` training steps, as a monitor with an interval would."""
    return [det.update(start_step + stride * i, v) for i, v in enumerate(values)]


def _entropy_stream(seed, n=400, drift=-2e-4, noise=0.01, level=3.0):
    """Spectral-entropy-like stream: slow healthy drift plus Gaussian noise (nats)."""
    rng = random.Random(seed)
    return [level + drift * t + noise * rng.gauss(0, 1) for t in range(n)]


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("direction", "down", "detector.direction must be 'drop' or 'rise'"),
        ("center", "mean", "detector.center must be 'median' or 'ema'"),
        ("warmup", 0, r"detector.warmup must be >= 1, got 0."),
        ("window", 1, r"detector.window must be >= 2, got 1."),
        ("patience", 0, r"detector.patience must be >= 1, got 0."),
        ("rearm", 0, r"detector.rearm must be >= 1, got 0."),
        ("warmup", 2.5, "detector.warmup must be an int"),
        ("ema_beta", 1.0, r"detector.ema_beta must be in \(0, 1\)"),
        ("num_mads", 0.0, "detector.num_mads must be a finite number > 0"),
        ("num_mads", math.inf, "detector.num_mads must be a finite number > 0"),
        ("min_rel_change", -0.1, "detector.min_rel_change must be a finite number >= 0"),
        ("min_abs_change", math.nan, "detector.min_abs_change must be a finite number >= 0"),
    ],
)
def test_bad_config_raises_pinned_message(field, value, match):
    with pytest.raises(ValueError, match=match):
        DetectorConfig(**{field: value})


def test_config_is_keyword_only_and_defaults():
    with pytest.raises(TypeError):
        DetectorConfig("drop")  # type: ignore[misc]
    cfgs = default_detector_configs()
    assert set(cfgs) >= {"attn_delta2", "attn_dw", "router_entropy", "router_weights"}
    assert cfgs["attn_delta2"].direction == "drop" and cfgs["router_entropy"].direction == "drop"
    assert cfgs["router_weights"].direction == "rise"
    assert default_detector_configs()["attn_dw"] is not cfgs["attn_dw"]  # fresh objects
    json.dumps(cfgs["attn_dw"].to_dict())


# -- decisions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("center", CENTERS)
@pytest.mark.parametrize("direction", ["drop", "rise"])
@pytest.mark.parametrize("drift", [-2e-4, 2e-4])
def test_quiet_on_noise_with_slow_drift(center, direction, drift):
    for seed in SEEDS:
        det = BaselineRelativeDetector(DetectorConfig(center=center, direction=direction))
        events = _feed(det, _entropy_stream(seed, drift=drift))
        assert not any(e.is_alarm for e in events), (seed, center)
        assert det.first_alarm_step is None and det.num_alarms == 0


@pytest.mark.parametrize("center", CENTERS)
@pytest.mark.parametrize("patience", [1, 3, 5])
def test_step_drop_alarms_after_patience(center, patience):
    for seed in SEEDS:
        values = _entropy_stream(seed)
        for i in range(200, 400):
            values[i] -= 0.5  # spectral collapse: entropy falls by 0.5 nats
        det = BaselineRelativeDetector(DetectorConfig(center=center, patience=patience))
        events = _feed(det, values, start_step=1000, stride=10)
        change_step = 1000 + 10 * 200
        assert det.first_alarm_step == change_step + 10 * (patience - 1)
        assert det.first_warning_step == change_step
        fired = [e for e in events if e.fired]
        assert len(fired) == 1 and fired[0].first_warning_step == change_step
        assert [e.status for e in events[200 : 200 + patience - 1]] == ["warning"] * (patience - 1)
        # Frozen baseline: the fault is never absorbed, the episode lasts to the end.
        assert all(e.is_alarm for e in events[200 + patience - 1 :])
        assert events[-1].baseline == pytest.approx(3.0 - 2e-4 * 200, abs=0.05)


def test_direction_rise_vs_drop():
    for seed in SEEDS:
        up = _entropy_stream(seed, n=200, drift=0.0, level=0.1, noise=0.005)
        for i in range(120, 200):
            up[i] += 0.3  # router weight similarity rises
        rise = BaselineRelativeDetector(DetectorConfig(direction="rise"))
        drop = BaselineRelativeDetector(DetectorConfig(direction="drop"))
        _feed(rise, up, stride=1)
        _feed(drop, up, stride=1)
        assert rise.first_alarm_step == 122
        assert drop.first_alarm_step is None
        assert rise.last_event.threshold > rise.last_event.baseline
        assert drop.last_event.threshold < drop.last_event.baseline
        assert drop.last_event.baseline == pytest.approx(0.4, abs=0.01)  # the rise is in band for drop


def test_warmup_respected():
    det = BaselineRelativeDetector(DetectorConfig(warmup=10, patience=1))
    wild = [3.0, 0.1, 5.0, -2.0, 7.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    events = _feed(det, wild, stride=1)
    assert [e.status for e in events] == ["warmup"] * 10
    assert math.isnan(events[0].baseline) and math.isnan(events[0].threshold)
    assert events[-1].baseline == 3.0  # the baseline is formed from the warmup values
    assert det.update(10, 0.5).status == "alarm"


def test_constant_stream_uses_relative_floor():
    cfg = DetectorConfig(warmup=5, patience=1, min_rel_change=0.05)
    det = BaselineRelativeDetector(cfg)
    _feed(det, [2.0] * 20, stride=1)
    e = det.update(20, 1.95)  # 2.5 % drop with zero MAD: inside the 5 % floor
    assert e.status == "ok" and e.scale == 0.0 and e.threshold == pytest.approx(1.9)
    assert det.update(21, 1.85).status == "alarm"
    # Centre near 0: only the absolute floor keeps a tiny change quiet.
    near_zero = BaselineRelativeDetector(DetectorConfig(direction="rise", warmup=5, patience=1, min_abs_change=0.02))
    _feed(near_zero, [0.0] * 10, stride=1)
    assert near_zero.update(10, 0.01).status == "ok"
    assert near_zero.update(11, 0.03).status == "alarm"


def test_rearm_requires_consecutive_in_band_checks():
    cfg = DetectorConfig(warmup=10, patience=2, rearm=3, num_mads=6.0)
    det = BaselineRelativeDetector(cfg)
    _feed(det, [1.0 + 0.001 * (-1) ** i for i in range(20)], stride=1)
    low, ok = 0.5, 1.0
    seq = [low, low, low, ok, ok, low, low, ok, ok, ok, low, low]
    events = [det.update(20 + i, v) for i, v in enumerate(seq)]
    assert [e.status for e in events] == [
        "warning", "alarm", "alarm",  # fires on the 2nd out-of-band check
        "ok", "ok",  # only 2 of the 3 in-band checks needed to re-arm
        "alarm", "alarm",  # still the same episode: no new alarm
        "ok", "ok", "ok",  # re-armed
        "warning", "alarm",  # a new alarm
    ]  # fmt: skip
    assert [e.step for e in events if e.fired] == [21, 31]
    assert det.num_alarms == 2 and det.first_alarm_step == 21 and det.first_warning_step == 20


@pytest.mark.parametrize("center", CENTERS)
def test_nan_alarms_immediately_and_is_not_absorbed(center):
    det = BaselineRelativeDetector(DetectorConfig(center=center, patience=3))
    _feed(det, _entropy_stream(0, n=60), stride=1)
    before = det.baseline()
    e = det.update(60, math.nan)
    assert e.status == "alarm" and e.fired and e.is_alarm and e.first_warning_step == 60
    assert det.baseline() == before
    assert BaselineRelativeDetector(DetectorConfig()).update(0, math.inf).is_alarm  # even in warmup


def test_unfrozen_baseline_absorbs_a_level_shift():
    values = _entropy_stream(1, n=300, drift=0.0)
    for i in range(100, 300):
        values[i] -= 0.5
    frozen = BaselineRelativeDetector(DetectorConfig(freeze_baseline_when_out=True))
    loose = BaselineRelativeDetector(DetectorConfig(freeze_baseline_when_out=False))
    ef, el = _feed(frozen, values, stride=1), _feed(loose, values, stride=1)
    assert frozen.first_alarm_step == loose.first_alarm_step == 102
    assert ef[-1].is_alarm and ef[-1].baseline == pytest.approx(3.0, abs=0.01)
    assert el[-1].status == "ok" and el[-1].baseline == pytest.approx(2.5, abs=0.01)


@pytest.mark.parametrize("center", CENTERS)
def test_state_round_trip_gives_identical_events(center):
    for seed in SEEDS[:3]:
        values = _entropy_stream(seed, n=300)
        values[150:] = [v - 0.4 for v in values[150:]]
        values[200] = math.nan
        cfg = DetectorConfig(center=center, rearm=2)
        a = BaselineRelativeDetector(cfg, name="s")
        _feed(a, values[:120])
        saved = json.loads(json.dumps(a.state_dict(), allow_nan=False))  # strict JSON
        assert saved["version"] == 1
        b = BaselineRelativeDetector(DetectorConfig(center=center, rearm=2), name="s")
        b.load_state_dict(saved)
        assert _feed(a, values[120:], 1200) == _feed(b, values[120:], 1200)
        assert a.state_dict() == b.state_dict()
        assert a.first_alarm_step is not None


def test_load_state_rejects_other_version_or_config():
    det = BaselineRelativeDetector(DetectorConfig())
    _feed(det, [1.0] * 15)
    state = det.state_dict()
    with pytest.raises(ValueError, match="state version 2 is not 1"):
        BaselineRelativeDetector(DetectorConfig()).load_state_dict({**state, "version": 2})
    with pytest.raises(ValueError, match="saved config"):
        BaselineRelativeDetector(DetectorConfig(num_mads=4.0)).load_state_dict(state)
    with pytest.raises(ValueError, match="needs a DetectorConfig"):
        BaselineRelativeDetector({"direction": "drop"})  # type: ignore[arg-type]


def test_event_is_frozen():
    e = DetectorEvent(1, 2.0, 2.0, 0.1, 1.5, "ok")
    assert not e.is_alarm and e.fired is False and e.first_warning_step is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.status = "alarm"  # type: ignore[misc]


# -- bank --------------------------------------------------------------------------------------


def _bank_run(bank, steps, fault_head=None, start=0):
    out = []
    rng = random.Random(7 + start)
    for step in range(start, start + steps):
        for head in range(3):
            v = 3.0 + 0.01 * rng.gauss(0, 1) - (0.5 if head == fault_head and step >= 40 else 0.0)
            out.append(bank.update(f"attn_delta2/layer_0/head_{head}", step, v))
        out.append(bank.update("router_weights/layer_1", step, 0.05 + 0.001 * rng.gauss(0, 1)))
    return out


def test_bank_creates_lazily_and_lists_alarms():
    bank = DetectorBank()
    assert len(bank) == 0
    _bank_run(bank, 60, fault_head=1)
    assert list(bank) == sorted(bank) and len(bank) == 4
    assert bank.family("router_weights/layer_1") == "router_weights"
    assert bank["router_weights/layer_1"].config.direction == "rise"
    alarms = bank.alarms()
    assert [e.name for e in alarms] == ["attn_delta2/layer_0/head_1"]
    assert bank.first_alarm_steps() == {"attn_delta2/layer_0/head_1": 42}


def test_bank_family_resolution_errors_and_override():
    bank = DetectorBank({"ent": DetectorConfig(warmup=2)}, family_of=lambda n: n.split("/")[1])
    bank.update("attn/ent/l0", 0, 1.0)
    assert bank.family("attn/ent/l0") == "ent"
    bank.update("custom_stream", 0, 1.0, family="ent")
    with pytest.raises(ValueError, match="unknown detector family 'nope'"):
        bank.update("x/nope/l0", 0, 1.0)
    with pytest.raises(ValueError, match="belongs to family 'ent'"):
        bank.update("custom_stream", 1, 1.0, family="other")
    with pytest.raises(ValueError, match="needs a DetectorConfig"):
        DetectorBank({"ent": {"direction": "drop"}})  # type: ignore[dict-item]


def test_bank_state_round_trip():
    a = DetectorBank()
    _bank_run(a, 45, fault_head=2)
    saved = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    b = DetectorBank()
    b.load_state_dict(saved)
    assert list(b) == list(a) and b.family("attn_delta2/layer_0/head_2") == "attn_delta2"
    assert _bank_run(a, 30, fault_head=2, start=45) == _bank_run(b, 30, fault_head=2, start=45)
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="does not configure"):
        DetectorBank({"attn_delta2": DetectorConfig()}).load_state_dict(saved)
    with pytest.raises(ValueError, match="bank state version"):
        DetectorBank().load_state_dict({**saved, "version": 0})


# -- absolute limit ------------------------------------------------------------------------------


def test_limit_alarms_inside_warmup_and_keeps_values_out_of_the_baseline():
    det = BaselineRelativeDetector(DetectorConfig(warmup=5, patience=3))
    events = [det.update(10 * i, v, limit=0.7) for i, v in enumerate([1.0, 0.5, 0.4, 0.3])]
    assert [e.status for e in events] == ["warmup", "warning", "warning", "alarm"]
    assert events[-1].fired and events[-1].beyond_limit and events[-1].first_warning_step == 10
    assert events[-1].threshold == 0.7 and events[-1].limit == 0.7
    assert det.baseline() == (1.0, 0.0)  # only the in-limit value formed the baseline
    assert det.first_alarm_step == 30


def test_limit_run_is_consecutive_in_warmup():
    det = BaselineRelativeDetector(DetectorConfig(warmup=10, patience=2))
    statuses = [det.update(i, v, limit=0.7).status for i, v in enumerate([0.5, 1.0, 0.5, 1.0, 0.5, 0.5])]
    assert statuses == ["warning", "warmup", "warning", "warmup", "warning", "alarm"]


def test_limit_is_not_used_once_the_baseline_is_formed():
    """A healthy stream that forms its baseline and then drifts slowly past the limit is judged
    by the baseline alone (the limit only stands in for a missing baseline)."""
    det = BaselineRelativeDetector(DetectorConfig(warmup=3, patience=1, min_rel_change=0.5))
    for i in range(3):
        det.update(i, 1.0, limit=0.9)
    below_limit_inside_band = det.update(3, 0.85, limit=0.9)  # band edge is 0.5
    assert below_limit_inside_band.status == "ok" and not below_limit_inside_band.beyond_limit
    assert below_limit_inside_band.threshold == pytest.approx(0.5)
    relative = det.update(4, 0.4, limit=0.9)
    assert relative.fired and not relative.beyond_limit


def test_a_stream_that_starts_beyond_the_limit_never_forms_a_baseline():
    det = BaselineRelativeDetector(DetectorConfig(warmup=3, patience=2, rearm=2))
    values = [1.0, 0.5, 0.4, 0.3, 0.3, 0.3, 0.3]
    events = [det.update(i, v, limit=0.7) for i, v in enumerate(values)]
    assert [e.status for e in events] == ["warmup", "warning", "alarm", "alarm", "alarm", "alarm", "alarm"]
    assert [e.fired for e in events].count(True) == 1 and all(e.beyond_limit for e in events[1:])
    assert det.baseline() == (1.0, 0.0)


def test_limit_for_rising_streams_and_no_limit_is_unchanged():
    det = BaselineRelativeDetector(DetectorConfig(direction="rise", warmup=5, patience=1))
    assert det.update(0, 0.5, limit=0.9).status == "warmup"
    assert det.update(1, 0.95, limit=0.9).fired
    plain, limited = (BaselineRelativeDetector(DetectorConfig(warmup=5)) for _ in range(2))
    values = _entropy_stream(3, n=120)
    for i, v in enumerate(values):
        a, b = plain.update(i, v), limited.update(i, v, limit=-1e9)  # a limit never reached
        assert (a.status, a.fired, a.threshold) == (b.status, b.fired, b.threshold)


def test_bank_passes_the_limit():
    bank = DetectorBank({"router_entropy": DetectorConfig(warmup=10, patience=1)})
    event = bank.update("router_entropy/layer_1", 20, 0.1, limit=0.69)
    assert event.fired and event.beyond_limit and bank.first_alarm_steps() == {"router_entropy/layer_1": 20}
