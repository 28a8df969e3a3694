"""``--mechmon-short-window``: Delta2 over the last ``interval`` steps beside the
``delta``-step window, from the snapshot the ring already holds; its detector family."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mechmon_megatron.cli.args import add_mechmon_args, config_from_args
from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.detect.null_model import load_tail_table
from mechmon_megatron.session import names
from mechmon_megatron.session.config import MechmonConfig, flag_of
from mechmon_megatron.session.detector_inputs import observation
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.writers import JsonlScalarWriter, WriterGroup
from tests.session.test_session import GROUPS, HEADS, ToyAttention, read_jsonl

INTERVAL, DELTA = 5, 15


def short_calibration(tmp_path) -> str:
    """The shipped table plus an ``attn_delta2_short`` section (a copy of attn_delta2's tails)."""
    table = load_tail_table().to_dict()
    for families in table["tails"].values():
        families["attn_delta2_short"] = families["attn_delta2"]
    path = tmp_path / "tails_short.json"
    path.write_text(json.dumps(table))
    return str(path)


def _session(tmp_path, name: str, layer: ToyAttention, **cfg) -> MonitoringSession:
    config = MechmonConfig(enabled=True, interval=INTERVAL, delta=DELTA, per_head_scalars=True,
                           log_dir=str(tmp_path), **cfg)
    writer = WriterGroup([JsonlScalarWriter(str(tmp_path / f"{name}.jsonl"))])
    return MonitoringSession(config, [layer.site()], writer=writer)


def dense_delta2_entropy(wq_prev, wk_prev, wq_now, wk_now, head: int, alpha: float = 2.0) -> float:
    """Brute force: the full hidden x hidden Delta2 of one head in float64, torch.linalg.svdvals."""
    g = head // (HEADS // GROUPS)
    q0, k0 = wq_prev[head].double().T, wk_prev[g].double().T  # paper layout: hidden x head_dim
    dq, dk = wq_now[head].double().T - q0, wk_now[g].double().T - k0
    s = torch.linalg.svdvals(dq @ k0.T + q0 @ dk.T)
    w = (s / s.max()) ** alpha
    p = w[w > 0] / w.sum()
    return float(-(p * p.log()).sum())


def dense_leading(wq_prev, wk_prev, wq_now, wk_now, head: int):
    g = head // (HEADS // GROUPS)
    q0, k0 = wq_prev[head].double().T, wk_prev[g].double().T
    dq, dk = wq_now[head].double().T - q0, wk_now[g].double().T - k0
    u, _, vh = torch.linalg.svd(dq @ k0.T + q0 @ dk.T)
    return u[:, 0], vh[0]


def _run_pair(tmp_path, steps: int):
    """Two sessions (short window on / off) on one weight history; every step's weights kept."""
    layer = ToyAttention(1, 3)
    twin = ToyAttention(1, 3)
    on = _session(tmp_path, "on", layer, short_window=True, detector_calibration=short_calibration(tmp_path))
    off = _session(tmp_path, "off", twin)
    history = {0: (layer.wq.clone(), layer.wk.clone())}
    on.on_train_start(0)
    off.on_train_start(0)
    sets = []
    for it in range(1, steps + 1):
        layer.step()
        twin.wq.copy_(layer.wq)
        twin.wk.copy_(layer.wk)
        history[it] = (layer.wq.clone(), layer.wk.clone())
        on.on_step_end(it)
        off.on_step_end(it)
        sets.append((on.snapshots.check_steps(), off.snapshots.check_steps()))
    return on, history, sets


def test_short_window_matches_the_dense_reference_and_needs_no_new_snapshot(tmp_path):
    on, history, sets = _run_pair(tmp_path, 40)
    assert all(a == b for a, b in sets)  # the same ring: no snapshot added for the short window
    rows_on = {r["step"]: r["scalars"] for r in read_jsonl(tmp_path / "on.jsonl")}
    rows_off = {r["step"]: r["scalars"] for r in read_jsonl(tmp_path / "off.jsonl")}
    checked = 0
    for step in range(INTERVAL, 41, INTERVAL):
        scalars = rows_on[step]
        prev, now = history[step - INTERVAL], history[step]
        per_head = []
        for head in range(HEADS):
            expected = dense_delta2_entropy(prev[0], prev[1], now[0], now[1], head)
            got = scalars[names.attn("delta2_entropy_short", 1, head)]
            assert got == pytest.approx(expected, rel=1e-7, abs=1e-9), (step, head)
            per_head.append(got)
        assert scalars[names.attn("delta2_entropy_short", 1)] == pytest.approx(sum(per_head) / HEADS, rel=1e-12)
        # The long window is untouched by the option: the same values as a session without it.
        for key, value in rows_off.get(step, {}).items():
            if key.startswith("mechmon/attn/"):
                assert scalars[key] == value, key
        checked += 1
    assert checked == 8
    # The first check (step 5) has no delta-old snapshot yet, only the interval-old one.
    assert names.attn("delta2_entropy", 1) not in rows_on[INTERVAL]
    assert names.attn("delta2_entropy_short", 1) in rows_on[INTERVAL]
    # Persistence of the leading direction between adjacent short windows, against dense svds.
    for step in range(2 * INTERVAL, 41, INTERVAL):
        w0, w1, w2 = history[step - 2 * INTERVAL], history[step - INTERVAL], history[step]
        for head in range(HEADS):
            u0, v0 = dense_leading(*w0, *w1, head)
            u1, v1 = dense_leading(*w1, *w2, head)
            expected = float((u0 @ u1).abs() * (v0 @ v1).abs())
            got = rows_on[step][names.attn("delta2_short_persistence", 1, head)]
            assert got == pytest.approx(expected, abs=1e-8), (step, head)
    assert names.attn("delta2_short_persistence", 1) not in rows_on[INTERVAL]  # no earlier short window
    # Sanity of the reference itself: the long window at step 40 against the dense Delta2.
    prev, now = history[40 - DELTA], history[40]
    assert rows_on[40][names.attn("delta2_entropy", 1, 0)] == pytest.approx(
        dense_delta2_entropy(prev[0], prev[1], now[0], now[1], 0), rel=1e-7)


def test_short_family_is_its_own_tests_in_the_union_bound(tmp_path):
    on, _, _ = _run_pair(tmp_path, 20)
    account = on.detector_account
    assert account is not None
    assert account.layers == {"attn_delta2": 1, "attn_dw": 1, "attn_delta2_short": 1}
    assert account.tests == 3
    assert "attn_delta2_short" in account.thresholds


def test_short_window_alarm_names_its_family(tmp_path):
    layer = ToyAttention(1, 0)
    session = _session(tmp_path, "alarm", layer, short_window=True, detector_calibration=short_calibration(tmp_path))
    session.on_train_start(0)
    families = set()
    for it in range(1, 401):
        layer.step(coherent_heads=(0, 1, 2, 3) if it > 300 else ())
        decision = session.on_step_end(it)
        families |= {a.family for a in decision.alerts}
    assert "attn_delta2_short" in families
    # The fault pushes one direction every step: its leading direction persists, healthy ones rotate.
    rows = {r["step"]: r["scalars"] for r in read_jsonl(tmp_path / "alarm.jsonl")}
    key = names.attn("delta2_short_persistence", 1)
    healthy = [rows[s][key] for s in range(200, 301, INTERVAL)]
    faulty = [rows[s][key] for s in range(330, 401, INTERVAL)]  # both windows after the onset (300)
    assert min(faulty) > 0.3 > max(healthy)  # measured: faulty 0.41-0.83, healthy 0.04-0.15


@pytest.mark.parametrize("interval, delta", [(20, 30), (20, 20), (20, 10)])
def test_short_window_needs_delta_a_larger_multiple_of_interval(interval, delta):
    with pytest.raises(ConfigError) as info:
        MechmonConfig(enabled=True, interval=interval, delta=delta, short_window=True)
    assert info.value.field == "short_window"
    assert info.value.render(flag_of).startswith("--mechmon-short-window needs --mechmon-delta a multiple of "
                                                 "--mechmon-interval")


def test_shipped_calibration_without_the_family_stops_startup_naming_it():
    with pytest.raises(ConfigError, match=r"^short_window: .*'attn_delta2_short'.*mechmon-calibrate"):
        MonitoringSession(MechmonConfig(enabled=True, interval=20, delta=100, short_window=True),
                          [ToyAttention(1, 0).site()])
    MonitoringSession(MechmonConfig(enabled=True, interval=20, delta=100), [ToyAttention(1, 0).site()])  # off: fine


def test_flag_and_stream_names():
    import argparse

    parser = add_mechmon_args(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args([])).short_window is False
    assert config_from_args(parser.parse_args(["--mechmon-short-window", "--mechmon-interval", "20"])).short_window
    obs = observation("mechmon/attn/delta2_entropy_short/layer_3/head_2", 1.5)
    assert obs is not None and (obs.family, obs.layer, obs.member) == ("attn_delta2_short", 3, "head_2")
    long = observation("mechmon/attn/delta2_entropy/layer_3/head_2", 1.5)
    assert long is not None and long.family == "attn_delta2"
    assert observation("mechmon/attn/delta2_entropy_short/layer_3", 1.5) is None  # the layer mean: not judged
    assert math.isclose(MechmonConfig(interval=20, delta=100).short_snapshot_key(200), 280)
