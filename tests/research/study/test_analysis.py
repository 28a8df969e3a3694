"""Offline analysis of the fault study on synthetic run files."""

import json
import math

import pytest

from mechmon_megatron.research.study import analysis as A

from .synthetic import check_rows, metrics_rows, write_run


def _data(tmp_path, metrics, checks):
    return A.RunData.from_files(*write_run(str(tmp_path), metrics, checks))


def test_stream_family_maps_the_session_streams():
    assert A.stream_family("mechmon/attn/delta2_entropy/layer_3/head_5") == "attn_delta2"
    assert A.stream_family("mechmon/attn/delta2_entropy/layer_3") is None  # layer mean: not judged
    assert A.stream_family("mechmon/attn/dw_entropy/layer_2") == "attn_dw"
    assert A.stream_family("mechmon/attn/dwk_entropy/layer_2") == "attn_dw"
    assert A.stream_family("mechmon/router/token_entropy/layer_1") == "router_entropy"
    assert A.stream_family("mechmon/router/token_entropy_p05/layer_1") is None
    assert A.stream_family("mechmon/router/weight_similarity/layer_4") == "router_weights"
    assert A.stream_family("mechmon/alarm") is None


def test_divergence_rule():
    rule = A.DivergenceRule(factor=1.5, window=1, reference_window=5, patience=3)
    steps = list(range(1, 41))
    flat = [2.0] * 40
    assert rule.first_step(steps, flat) is None
    jump = [2.0] * 20 + [3.5] * 20
    assert rule.first_step(steps, jump) == 21
    short_spike = [2.0] * 20 + [3.5, 3.5] + [2.0] * 18  # shorter than patience
    assert rule.first_step(steps, short_spike) is None
    nan = [2.0] * 10 + [math.nan] + [2.0] * 29
    assert rule.first_step(steps, nan) == 11
    smoothed = A.DivergenceRule(factor=1.5, window=4, reference_window=5, patience=3)
    # alternating spikes: the running minimum of the 5-step mean is 2.48, the level 3.72
    noisy = [2.0, 3.2] * 10 + [4.0] * 20
    assert smoothed.first_step(steps, noisy) == 23  # mean of steps 20-23 = (3.2 + 3 x 4) / 4 = 3.8
    with pytest.raises(ValueError, match="divergence rule needs"):
        A.DivergenceRule(factor=1.0).first_step(steps, flat)


def test_collapse_rule():
    rule = A.CollapseRule(max_vio_level=2.0, patience=3)
    quiet = [(t, {"mechmon/router/max_vio/layer_1": 0.5}) for t in range(10, 200, 10)]
    assert rule.first_step(quiet) is None
    rows = [(t, {"mechmon/router/max_vio/layer_1": 0.5, "mechmon/router/max_vio/layer_2": 2.5 if t >= 100 else 0.3})
            for t in range(10, 200, 10)]
    assert rule.first_step(rows) == 100
    assert rule.first_step([(t, {"x": 1.0}) for t in range(10, 50, 10)]) is None  # dense model


def test_read_jsonl_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 1, "lm_loss": 2.0}\n{"iteration": 2, "lm_')
    assert A.read_jsonl(str(path)) == [{"iteration": 1, "lm_loss": 2.0}]
    assert A.read_jsonl(str(tmp_path / "missing.jsonl")) == []


def test_clean_synthetic_run_has_no_mechmon_alarm(tmp_path):
    data = _data(tmp_path, metrics_rows(600), check_rows(600))
    result = A.analyze_run(data, fault_onset=None, interval=10, delta=10)
    assert all(result["first_alarm"][f] is None for f in A.MECHMON_FAMILIES)
    assert result["divergence_step"] is None
    assert result["expert_collapse_step"] is None
    assert set(result["first_alarm"]) == set(A.ALARM_KEYS)
    assert result["online_first_alarm"] is None and result["replay_first_alarm_default_setting"] is None


def test_attention_drop_alarms_first_in_the_right_family(tmp_path):
    data = _data(tmp_path, metrics_rows(800, diverge_at=600), check_rows(800, attn_drop_at=300))
    result = A.analyze_run(data, fault_onset=250, interval=10, delta=10)
    first = result["first_alarm"]
    # checks every 10 steps: both heads of layer 1 halve at 300 (residuals clipped at 8, CUSUM
    # +7 per check); the layer threshold of this 2-layer job at R = 0.01 is ~8.6: fires at 310
    assert first["attn_delta2"] == 310
    assert result["first_alarm_stream"]["attn_delta2"] == "layer 1 head_0 head_1 (cusum, layer test)"
    assert first["router_entropy"] is None and first["router_weights"] is None
    assert first["wq_spectral_norm"] == 300  # 4x growth of W_q sigma_max in layer 1
    div = result["divergence_step"]
    assert div is not None and 600 <= div <= 640
    steps, share = (
        result["lead_to_divergence"]["attn_delta2"]["steps"],
        result["lead_to_divergence"]["attn_delta2"]["share"],
    )
    assert steps == div - 310 and share == pytest.approx((div - 310) / (div - 250))
    assert result["false_alarm"]["attn_delta2"] is False


def test_router_drop_and_collapse(tmp_path):
    data = _data(tmp_path, metrics_rows(800), check_rows(800, router_drop_at=300, collapse_at=500))
    result = A.analyze_run(data, fault_onset=1, interval=10, delta=10)
    alarm = result["first_alarm"]["router_entropy"]
    assert 300 < alarm <= 360  # one router of two halves: the family CUSUM (+3 per check) fires first
    assert result["expert_collapse_step"] == 500
    assert result["lead_to_collapse"]["router_entropy"]["steps"] == 500 - alarm
    assert result["first_alarm"]["attn_delta2"] is None


def test_symptom_rules_fire_on_a_loss_spike_and_logit_growth(tmp_path):
    metrics = metrics_rows(600, logit_growth_at=400)
    for row in metrics[449:460]:
        row["lm_loss"] = 50.0
    data = _data(tmp_path, metrics, check_rows(600))
    first = A.replay_symptoms(data)
    assert first["loss_6sigma"] == 450
    assert first["loss_10x"] == 450
    assert first["loss_2x_mean"] == 454  # > 4 consecutive steps: the 5th fires
    assert first["max_attn_logit"] is not None and 400 < first["max_attn_logit"] < 460
    assert first["grad_norm_6sigma"] is None


def test_missing_max_attn_logit_gives_no_alarm(tmp_path):
    metrics = [{k: v for k, v in row.items() if k != "max_attn_logit"} for row in metrics_rows(300)]
    data = _data(tmp_path, metrics, check_rows(300))
    assert A.replay_symptoms(data)["max_attn_logit"] is None


def test_lead_cases():
    assert A.lead(None, 100, 0) == (None, None)
    assert A.lead(50, None, 0) == (None, None)
    assert A.lead(40, 100, 50) == (None, None)  # before the onset: a false alarm, not a lead
    assert A.lead(120, 100, 50) == (None, None)  # after the event
    assert A.lead(60, 100, 50) == (40, pytest.approx(0.8))
    assert A.lead(60, 100, None) == (40, pytest.approx(0.4))


def test_choose_detector_setting_takes_the_most_sensitive_quiet_one(tmp_path):
    checks = check_rows(800)
    # a 3-check dip of 3.5 % (7 sigma) on a clean run: the CUSUM peaks near 18 and decays; the
    # most sensitive rates alarm on it, a less sensitive one does not
    for row in checks[40:43]:
        row["scalars"]["mechmon/router/token_entropy/layer_2"] -= 0.07
    data = _data(tmp_path, metrics_rows(800), checks)
    chosen, log = A.choose_detector_setting(data, margin=0, interval=10, delta=10)
    index = A.CALIBRATION_CANDIDATES.index(chosen)
    assert index > 0
    assert all(entry["alarms"] for entry in log[:index])
    assert log[index]["alarms"] == {}
    assert log[-1] == {"quiet": index, "chosen": index, "margin": 0}
    assert A.replay_mechmon(data, chosen, 10, 10)["first_alarm"] == {f: None for f in A.MECHMON_FAMILIES}
    json.dumps(log)  # serialisable for results.json
    with_margin, _ = A.choose_detector_setting(data, margin=1, interval=10, delta=10)
    assert A.CALIBRATION_CANDIDATES.index(with_margin) == index + 1
    last, _ = A.choose_detector_setting(data, margin=100, interval=10, delta=10)
    assert last == A.CALIBRATION_CANDIDATES[-1]
    with pytest.raises(ValueError, match="margin must be >= 0"):
        A.choose_detector_setting(data, margin=-1)


def test_router_onset_of_a_combined_fault(tmp_path):
    """combined: the high LR acts from step 1, so an early router alarm is no false alarm."""
    data = _data(tmp_path, metrics_rows(800), check_rows(800, router_drop_at=300))
    plain = A.analyze_run(data, fault_onset=500, interval=10, delta=10)
    assert plain["first_alarm"]["router_entropy"] < 500 and plain["false_alarm"]["router_entropy"] is True
    combined = A.analyze_run(data, fault_onset=500, router_fault_onset=1, interval=10, delta=10)
    assert combined["false_alarm"]["router_entropy"] is False
    assert combined["router_fault_onset"] == 1


def test_replay_applies_the_recorded_routing_entropy_floor(tmp_path):
    """A real session collapses routing inside its warm-up; the replay of its JSONL, which
    carries the floor as a scalar, raises the same alarm at the same check, and the
    baseline-only replay (floor scalars removed) does not."""
    import torch

    from mechmon_megatron.session.config import MechmonConfig
    from mechmon_megatron.session.host import RouterSite
    from mechmon_megatron.session.session import MonitoringSession
    from mechmon_megatron.session.writers import JsonlScalarWriter

    experts = 8
    site = RouterSite(1, experts, 2, weight=lambda: torch.eye(experts, 16), reduce_sum=lambda v: v, reports=True)
    setting = A.DEFAULT_DETECTOR
    cfg = MechmonConfig(enabled=True, interval=10, delta=10, monitors=("router",))
    path = tmp_path / "mechmon_scalars.jsonl"
    session = MonitoringSession(cfg, [], [site], writer=JsonlScalarWriter(str(path)))
    online = []
    for it in range(1, 101):
        if session.on_step_start(it):
            margin = 0.1 * it  # the winner's margin grows every check (stable-winner loop)
            logits = torch.zeros(64, experts)
            logits[:, 3] = margin
            site.capture(logits)
        if session.on_step_end(it).alarm:
            online.append(it)
    session.close()
    data = A.RunData.from_files(str(tmp_path / "none.jsonl"), str(path))
    replay = A.replay_mechmon(data, setting, 10, 10)["first_alarm"]["router_entropy"]
    assert online and replay == online[0] < 200  # inside the 200-step warm-up
    stripped = A.RunData(
        checks=[(s, {k: v for k, v in sc.items() if "token_entropy_floor" not in k}) for s, sc in data.checks]
    )
    assert A.replay_mechmon(stripped, setting, 10, 10)["first_alarm"]["router_entropy"] is None
