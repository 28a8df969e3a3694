"""Symptom-level baseline rules on synthetic loss / grad-norm streams."""

import json
import math
import random

import pytest

from mechmon_megatron.research.baselines.symptom_rules import (
    SYMPTOM_STREAMS,
    FoundrySpikeRule,
    GrowthRule,
    MegatronSpikeRule,
    OlmoSpikeRule,
    RunningMeanRelativeRule,
    SymptomRule,
    build_symptom_rules,
)

SEEDS = range(6)  # several seeds: the thresholds are not tuned to one


def _loss_stream(seed: int, n: int = 400) -> list[float]:
    """Slowly decaying loss with multiplicative noise, ~3.0 -> ~2.6."""
    rng = random.Random(seed)
    return [(2.5 + 0.5 * math.exp(-t / 300)) * (1 + 0.01 * rng.gauss(0, 1)) for t in range(n)]


def _grad_norm_stream(seed: int, n: int = 400) -> list[float]:
    """Positive, heavy-ish tailed grad norm around 1."""
    rng = random.Random(seed)
    return [math.exp(0.1 * rng.gauss(0, 1)) for _ in range(n)]


def _run(rule: SymptomRule, values: list[float], start_step: int = 0) -> list[bool]:
    return [rule.update(start_step + i, v) for i, v in enumerate(values)]


RULE_FACTORIES = {
    "olmo": lambda: OlmoSpikeRule(),
    "megatron": lambda: MegatronSpikeRule(),
    "foundry": lambda: FoundrySpikeRule(),
    "running_mean": lambda: RunningMeanRelativeRule(),
    "growth": lambda: GrowthRule(),
}


@pytest.mark.parametrize("kind", sorted(RULE_FACTORIES))
@pytest.mark.parametrize("stream", [_loss_stream, _grad_norm_stream])
def test_quiet_on_stationary_noise(kind, stream):
    for seed in SEEDS:
        rule = RULE_FACTORIES[kind]()
        assert not any(_run(rule, stream(seed))), (kind, seed)
        assert rule.first_alarm_step is None and rule.num_alarms == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_olmo_fires_on_spike(seed):
    values = _loss_stream(seed)
    values[300] *= 1.5
    rule = OlmoSpikeRule()
    alarms = _run(rule, values, start_step=1000)
    assert rule.first_alarm_step == 1300 and alarms.count(True) == 1


def test_olmo_needs_history():
    rule = OlmoSpikeRule(window=10, num_sigma=3.0, min_history=5)
    assert not any(_run(rule, [1.0, 1.1, 0.9, 1.0]))
    assert not rule.update(4, 100.0)  # only 4 values of history
    assert rule.update(5, 1000.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_megatron_fires_on_tenfold_value(seed):
    values = _grad_norm_stream(seed)
    values[50] = 50.0  # inside the first 100 values: raises the reference, never alarms
    values[250] = 600.0  # >= 10 x 50
    rule = MegatronSpikeRule()
    alarms = _run(rule, values)
    assert rule.first_alarm_step == 250 and alarms.count(True) == 1
    assert not MegatronSpikeRule(first_n=10).update(0, 1e9)  # first values never alarm


@pytest.mark.parametrize("seed", SEEDS)
def test_foundry_needs_more_than_patience_steps(seed):
    values = _loss_stream(seed)
    for t in range(200, 204):  # 4 high steps = patience: no alarm
        values[t] *= 3
    for t in range(300, 310):
        values[t] *= 3
    rule = FoundrySpikeRule()
    alarms = _run(rule, values)
    assert rule.first_alarm_step == 304  # the patience + 1 = 5th consecutive high step
    assert [t for t, a in enumerate(alarms) if a] == list(range(304, 310))


@pytest.mark.parametrize("seed", SEEDS)
def test_running_mean_fires_on_relative_jump(seed):
    values = _loss_stream(seed)
    values[150] *= 1.8
    rule = RunningMeanRelativeRule()
    alarms = _run(rule, values)
    assert rule.first_alarm_step == 150 and alarms.count(True) == 1
    assert not any(_run(RunningMeanRelativeRule(warmup=5), [1.0, 5.0, 9.0, 20.0, 50.0]))


@pytest.mark.parametrize("seed", SEEDS)
def test_growth_fires_when_signal_grows(seed):
    rng = random.Random(seed)
    # Max attention logit: flat for 200 steps, then grows linearly by 2 % per step.
    values = [10 * (1 + 0.02 * max(0, t - 200)) * (1 + 0.02 * rng.gauss(0, 1)) for t in range(400)]
    rule = GrowthRule(reference_steps=100, factor=3.0)
    _run(rule, values)
    assert rule.reference == pytest.approx(10, rel=0.02)
    # 10 (1 + 0.02 k) >= 30 at k = 100; noise moves it by a few steps.
    assert 290 <= rule.first_alarm_step <= 310


def test_zero_reference_rules_stay_quiet_on_zero_stream():
    for rule in (MegatronSpikeRule(first_n=3), GrowthRule(reference_steps=3)):
        assert not any(_run(rule, [0.0] * 10))
        assert rule.update(10, 1e-3)


@pytest.mark.parametrize("kind", sorted(RULE_FACTORIES))
def test_nonfinite_alarms_and_does_not_poison(kind):
    rule = RULE_FACTORIES[kind]()
    values = _loss_stream(0, 300)
    _run(rule, values[:200])
    assert rule.update(200, math.nan)
    assert rule.update(201, math.inf)
    assert rule.first_alarm_step == 200
    assert not any(_run(rule, values[200:], start_step=202))
    assert rule.num_alarms == 2


@pytest.mark.parametrize("kind", sorted(RULE_FACTORIES))
def test_state_round_trip_continues_identically(kind):
    for seed in SEEDS[:3]:
        values = _loss_stream(seed, 400)
        for t in range(260, 275):
            values[t] *= 12  # enough for every rule, the Megatron one included
        a = RULE_FACTORIES[kind]()
        _run(a, values[:150])
        saved = json.loads(json.dumps(a.state_dict()))  # must survive a JSON file
        b = RULE_FACTORIES[kind]()
        b.load_state_dict(saved)
        assert _run(a, values[150:], 150) == _run(b, values[150:], 150)
        assert a.state_dict() == b.state_dict()
        assert a.first_alarm_step == b.first_alarm_step is not None


def test_load_state_mismatch_raises():
    rule = OlmoSpikeRule(window=16)
    _run(rule, [1.0] * 20)
    state = rule.state_dict()
    with pytest.raises(ValueError, match="saved config"):
        OlmoSpikeRule(window=32).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        OlmoSpikeRule(window=16).load_state_dict({**state, "version": 2})
    with pytest.raises(ValueError, match="is for a 'olmo_spike' rule"):
        GrowthRule().load_state_dict(state)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: OlmoSpikeRule(window=1), "olmo_spike.window must be >= 2"),
        (lambda: OlmoSpikeRule(window=8, min_history=9), "olmo_spike.min_history must be in"),
        (lambda: MegatronSpikeRule(factor=1.0), "megatron_spike.factor must be > 1"),
        (lambda: FoundrySpikeRule(patience=-1), "foundry_spike.patience must be >= 0"),
        (lambda: RunningMeanRelativeRule(beta=1.0), r"running_mean_relative.beta must be in \(0, 1\)"),
        (lambda: GrowthRule(reference_steps=0), "growth.reference_steps must be >= 1"),
    ],
)
def test_bad_settings_raise(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_build_symptom_rules():
    rules = build_symptom_rules()
    assert set(rules) == {f"{s}/{k}" for s, kinds in SYMPTOM_STREAMS.items() for k in kinds}
    assert "loss/olmo_spike" in rules and "wq_spectral_norm/growth" in rules
    assert all(rule.name == key for key, rule in rules.items())
    assert isinstance(rules["grad_norm/foundry_spike"], FoundrySpikeRule)
    assert rules["loss/olmo_spike"].window == 128 and rules["loss/megatron_spike"].factor == 10.0
    assert set(build_symptom_rules(["loss"])) == {f"loss/{k}" for k in SYMPTOM_STREAMS["loss"]}
    with pytest.raises(ValueError, match="unknown symptom streams"):
        build_symptom_rules(["lr"])
