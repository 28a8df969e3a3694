"""The host-agnostic session on plain tensors: schedule, detectors, alarms, writers, state."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mechmon_megatron.session import names
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import AttentionSite, FullQK, QKWeights, RouterSite
from mechmon_megatron.session.session import MechmonStrictError, MonitoringSession
from mechmon_megatron.session.writers import JsonlScalarWriter, TensorBoardScalarWriter, WriterGroup

HEADS, GROUPS, HEAD_DIM, HIDDEN, EXPERTS = 4, 2, 8, 32, 4


class ToyAttention:
    """A layer's Q/K weights that a test updates step by step (the 'host')."""

    def __init__(self, layer_number: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.layer_number = layer_number
        self.wq = torch.randn(HEADS, HEAD_DIM, HIDDEN, generator=g) * 0.02
        self.wk = torch.randn(GROUPS, HEAD_DIM, HIDDEN, generator=g) * 0.02
        self.gen = g

    def step(self, coherent_heads: tuple[int, ...] = (), scale: float = 1e-3) -> None:
        self.wq += scale * torch.randn(self.wq.shape, generator=self.gen)
        self.wk += scale * torch.randn(self.wk.shape, generator=self.gen)
        for head in coherent_heads:
            # The fault signature: one rank-1 direction added to a head every step.
            u = torch.ones(HEAD_DIM, 1) / math.sqrt(HEAD_DIM)
            v = torch.ones(1, HIDDEN) / math.sqrt(HIDDEN)
            self.wq[head] += 40 * scale * (u @ v)

    def site(self) -> AttentionSite:
        return AttentionSite(
            self.layer_number,
            read_heads=lambda: QKWeights(self.wq, self.wk, 0),
            read_full=lambda: FullQK(self.wq.reshape(-1, HIDDEN), self.wk.reshape(-1, HIDDEN)),
        )


def make_session(tmp_path, layers, routers=(), **overrides) -> MonitoringSession:
    # interval 5: the detector's warm-up is 200 steps (40 checks)
    cfg = dict(enabled=True, interval=5, delta=5, log_dir=str(tmp_path))
    cfg.update(overrides)
    writer = WriterGroup(
        [JsonlScalarWriter(str(tmp_path / "scalars.jsonl")), TensorBoardScalarWriter.in_directory(str(tmp_path / "tb"))]
    )
    return MonitoringSession(MechmonConfig(**cfg), [layer.site() for layer in layers], list(routers), writer=writer)


def run(session, layers, steps, start=0, fault_from=None, fault_heads=(0, 1, 2, 3), fault_layer=0):
    decisions = []
    session.on_train_start(start)
    for it in range(start + 1, start + steps + 1):
        session.on_step_start(it)
        for i, layer in enumerate(layers):
            faulty = fault_from is not None and it >= fault_from and i == fault_layer
            layer.step(coherent_heads=fault_heads if faulty else ())
        decisions.append(session.on_step_end(it))
    return decisions


def read_jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_disabled_session_does_nothing(tmp_path):
    session = MonitoringSession(MechmonConfig(enabled=False))
    assert session.on_step_start(1) is False
    decision = session.on_step_end(100)
    assert not decision.alarm and session.state_dict() == {}


def test_healthy_run_writes_scalars_and_never_alarms(tmp_path):
    layers = [ToyAttention(1, 0), ToyAttention(2, 1)]
    session = make_session(tmp_path, layers)
    decisions = run(session, layers, 400)
    session.close()
    assert not any(d.alarm for d in decisions)
    rows = read_jsonl(tmp_path / "scalars.jsonl")
    assert [r["step"] for r in rows] == list(range(5, 401, 5))
    last = rows[-1]["scalars"]
    for layer in (1, 2):
        assert names.attn("delta2_entropy", layer) in last
        assert names.attn("dw_entropy", layer) in last
    assert last[names.ALARM] == 0.0 and last[names.ERRORS] == 0.0 and last[names.OVERHEAD_MS] > 0
    assert "mechmon/detect/attn_delta2/cusum/layer_2" in last and "mechmon/detect/attn_dw/cusum" in last


def test_coherent_update_alarms_naming_layer_and_heads(tmp_path):
    layers = [ToyAttention(1, 0), ToyAttention(2, 1)]
    session = make_session(tmp_path, layers, action="warn")
    decisions = run(session, layers, 330, fault_from=301, fault_heads=(1, 2, 3), fault_layer=1)
    alarms = [a for d in decisions for a in d.alerts]
    assert alarms, "a coherent rank-1 update stream must alarm"
    first = alarms[0]
    assert 300 < first.iteration <= 320 and first.layer == 2 and first.kind == "cusum"
    head_alarms = [a for a in alarms if a.family == "attn_delta2"]
    assert head_alarms and set(head_alarms[0].heads) <= {1, 2, 3} and head_alarms[0].heads
    assert first.first_warning_step >= 295  # the change point: the CUSUM's last zero before the shift
    assert "layer 2" in first.describe()
    assert not any(d.alarm for d in decisions if d.iteration <= 300)


def test_one_wild_head_is_not_a_head_alarm(tmp_path):
    layers = [ToyAttention(1, 0), ToyAttention(2, 1)]
    session = make_session(tmp_path, layers)
    decisions = run(session, layers, 330, fault_from=301, fault_heads=(3,), fault_layer=1)
    assert not [a for d in decisions for a in d.alerts if a.family == "attn_delta2"]


def test_tensorboard_event_file_has_mechmon_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    layers = [ToyAttention(1, 0)]
    session = make_session(tmp_path, layers)
    run(session, layers, 20)
    session.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert names.attn("delta2_entropy", 1) in tags and names.ALARM in tags
    steps = [e.step for e in acc.Scalars(names.attn("delta2_entropy", 1))]
    assert steps == [5, 10, 15, 20]


def test_drill_raises_alarm_and_abort_decision(tmp_path):
    layers = [ToyAttention(1, 0)]
    session = make_session(tmp_path, layers, drill_at=7, action="checkpoint-and-abort", exit_code=43)
    decisions = run(session, layers, 7)
    last = decisions[-1]
    assert last.alarm and last.abort and last.exit_code == 43
    assert not any(d.alarm for d in decisions[:-1])
    session.on_checkpoint_saved(5, str(tmp_path / "iter_5"))
    path = session.on_abort_checkpoint_saved(7, str(tmp_path / "iter_7"))
    alert = json.load(open(path))
    assert alert["iteration"] == 7 and alert["family"] == "drill" and alert["exit_code"] == 43
    assert alert["last_checkpoint_before_first_warning"]["iteration"] == 5


def test_state_round_trip_keeps_baseline_no_warmup_after_resume(tmp_path):
    layers = [ToyAttention(1, 0)]
    session = make_session(tmp_path, layers)
    run(session, layers, 250)
    state = json.loads(json.dumps(session.state_dict()))  # must survive JSON (checkpoints, alerts)
    assert state["version"] == 2 and state["detector"]["trends"]
    resumed = make_session(tmp_path / "b", layers)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["detector"] == state["detector"]  # pending until the first check
    # Fault right after resume: the restored baseline alarms without a new warm-up period.
    decisions = run(resumed, layers, 40, start=250, fault_from=251)
    first = next(d for d in decisions if d.alarm)
    assert first.iteration <= 250 + 20  # no snapshot at 255, then a few checks of CUSUM


def test_state_of_the_per_stream_detector_is_not_reused(tmp_path, caplog):
    layers = [ToyAttention(1, 0)]
    session = make_session(tmp_path, layers)
    session.load_state_dict({"version": 1, "detectors": {}, "checkpoints": [{"iteration": 5, "path": None}]})
    assert session.checkpoints == [{"iteration": 5, "path": None}] and "re-learns" in caplog.text
    with pytest.raises(ValueError, match="version 7"):
        session.load_state_dict({"version": 7})


def test_nonfinite_weights_alarm_names_layer(tmp_path):
    layers = [ToyAttention(1, 0), ToyAttention(4, 1)]
    session = make_session(tmp_path, layers)
    run(session, layers, 10)
    layers[1].wq[0, 0, 0] = float("nan")
    decisions = run(session, layers, 5, start=10)
    alerts = [a for d in decisions for a in d.alerts]
    assert alerts and alerts[0].family == "nonfinite" and alerts[0].layer == 4


def test_monitor_exception_is_counted_not_raised_unless_strict(tmp_path):
    layer = ToyAttention(1, 0)
    broken = AttentionSite(1, read_heads=lambda: QKWeights(layer.wq, layer.wk[:1, :, :3], 0), read_full=lambda: None)
    session = MonitoringSession(MechmonConfig(enabled=True, interval=5, delta=5), [broken], writer=WriterGroup())
    decisions = run(session, [layer], 10)
    assert not any(d.alarm for d in decisions)
    assert session.errors == 2
    strict = MonitoringSession(
        MechmonConfig(enabled=True, interval=5, delta=5, strict=True), [broken], writer=WriterGroup()
    )
    # Strict: the failure travels with the check's payload; every rank raises the same error.
    with pytest.raises(MechmonStrictError, match=r"rank 0, iteration 5, phase kernel, layer 1: ValueError"):
        run(strict, [layer], 10)


def test_router_site_statistics(tmp_path):
    weight = torch.randn(EXPERTS, HIDDEN)
    site = RouterSite(1, EXPERTS, 2, weight=lambda: weight, reduce_sum=lambda v: v, reports=True)
    session = make_session(tmp_path, [], routers=[site])
    logits = torch.randn(16, 2, EXPERTS)
    for it in range(1, 11):
        if session.on_step_start(it):
            site.capture(logits)  # what the adapter's capture hook does
        session.on_step_end(it)
    session.close()
    rows = read_jsonl(tmp_path / "scalars.jsonl")
    assert [r["step"] for r in rows] == [5, 10]
    got = rows[-1]["scalars"]
    p = torch.softmax(logits.double(), -1)
    expected = float((-(p * p.log()).sum(-1)).mean())
    assert got[names.router("token_entropy", 1)] == pytest.approx(expected, rel=1e-6)
    u = torch.nn.functional.normalize(weight.double(), dim=1)
    cos = u @ u.T
    expected_s = float((cos.sum() - cos.diagonal().sum()) / (EXPERTS * (EXPERTS - 1)))
    assert got[names.router("weight_similarity", 1)] == pytest.approx(expected_s, rel=1e-9, abs=1e-12)
    assert site.summary is None  # consumed by the check


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"interval": 0}, "--mechmon-interval"),
        ({"delta": -1}, "--mechmon-delta"),
        ({"exit_code": 1}, "--mechmon-exit-code"),
        ({"exit_code": 17}, "--mechmon-exit-code"),
        ({"action": "explode"}, "--mechmon-action"),
        ({"monitors": ("attn", "mlp")}, "--mechmon-monitors"),
        ({"snapshot_device": "gpu"}, "--mechmon-snapshot-device"),
        ({"alpha": 0.0}, "--mechmon-alpha"),
        ({"router_min_effective_experts": 0.5}, "--mechmon-router-min-effective-experts"),
        ({"router_min_effective_experts": "many"}, "--mechmon-router-min-effective-experts"),
        ({"router_min_effective_experts": math.inf}, "--mechmon-router-min-effective-experts"),
        ({"false_alarm_rate": 0.0}, "--mechmon-false-alarm-rate"),
        ({"false_alarm_rate": math.nan}, "--mechmon-false-alarm-rate"),
        ({"detector_calibration": "/no/such/tails.json"}, "--mechmon-detector-calibration"),
    ],
)
def test_bad_config_names_the_flag(overrides, flag):
    from mechmon_megatron.detect.config_error import ConfigError
    from mechmon_megatron.session.config import flag_of

    with pytest.raises(ConfigError) as info:  # names the field; the command line spells it as its flag
        MechmonConfig(enabled=True, **overrides)
    assert flag_of(info.value.field) == flag and info.value.render(flag_of).startswith(flag + " ")


def _router_session(tmp_path, logits, topk=2, score_function="softmax", **overrides):
    weight = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0))
    site = RouterSite(1, EXPERTS, topk, weight=lambda: weight, reduce_sum=lambda v: v, reports=True,
                      score_function=score_function)
    session = make_session(tmp_path, [], routers=[site], **overrides)
    decisions = []
    for it in range(1, 21):
        if session.on_step_start(it):
            site.capture(logits)
        decisions.append(session.on_step_end(it))
    session.close()
    return decisions, read_jsonl(tmp_path / "scalars.jsonl")


def _peaked_logits(margin: float) -> torch.Tensor:
    """Every token prefers expert 0 by ``margin`` nats over the others."""
    logits = torch.zeros(32, EXPERTS)
    logits[:, 0] = margin
    return logits


def test_routing_entropy_floor_alarms_inside_the_warmup(tmp_path):
    # Entropy of (e^8, 1, 1, 1)/Z is ~0.01 nats: 1.0 effective expert, below top-k = 2.
    decisions, rows = _router_session(tmp_path, _peaked_logits(8.0))
    alarms = [d for d in decisions if d.alarm]
    # the floor fires at the third check below it (inside the 40-check warm-up), where the
    # baseline-relative rule could not judge anything yet.
    assert [d.iteration for d in alarms] == [15]
    alert = alarms[0].alerts[0]
    assert (alert.family, alert.layer, alert.baseline) == ("router_entropy", 1, None)
    assert alert.threshold == pytest.approx(math.log(2)) and "effective experts" in alert.reason
    scalars = rows[-1]["scalars"]
    assert scalars[names.router("token_entropy_floor", 1)] == pytest.approx(math.log(2))
    assert scalars[names.router("effective_experts", 1)] == pytest.approx(
        math.exp(scalars[names.router("token_entropy", 1)]), rel=1e-12
    )
    assert "no baseline yet" in alert.describe()


@pytest.mark.parametrize("setting", ["off", 0])
def test_routing_entropy_floor_can_be_turned_off(tmp_path, setting):
    decisions, rows = _router_session(tmp_path, _peaked_logits(8.0), router_min_effective_experts=setting)
    assert not any(d.alarm for d in decisions)
    assert names.router("token_entropy_floor", 1) not in rows[-1]["scalars"]


def test_routing_entropy_above_the_floor_is_quiet(tmp_path):
    # margin 1: entropy ~1.27 nats = 3.6 effective experts of 4, above 2.
    decisions, _ = _router_session(tmp_path, _peaked_logits(1.0))
    assert not any(d.alarm for d in decisions)
    # A user floor above that level alarms on the same router.
    decisions, _ = _router_session(tmp_path, _peaked_logits(1.0), router_min_effective_experts=3.9)
    assert [d.iteration for d in decisions if d.alarm] == [15]


@pytest.mark.parametrize("setting", ["topk", 1.5])
def test_sigmoid_router_has_no_floor_whatever_the_setting(tmp_path, setting):
    # Normalised sigmoid scores of (10, -20, -20, -20): ~1e-8 nats, far below log 2; no floor
    # (argued for softmax only), so nothing alarms inside the warm-up.
    logits = torch.full((32, EXPERTS), -20.0)
    logits[:, 0] = 10.0
    decisions, rows = _router_session(tmp_path, logits, score_function="sigmoid", router_min_effective_experts=setting)
    assert not any(d.alarm for d in decisions)
    scalars = rows[-1]["scalars"]
    assert names.router("token_entropy_floor", 1) not in scalars
    p = torch.sigmoid(logits.double())
    p = p / p.sum(-1, keepdim=True)
    assert scalars[names.router("token_entropy", 1)] == pytest.approx(float((-(p * p.log()).sum(-1)).mean()),
                                                                     rel=1e-4, abs=1e-7)


def test_top1_router_has_no_floor_under_topk():
    cfg = MechmonConfig(enabled=True)
    assert cfg.router_entropy_floor(num_experts=8, topk=1) is None
    assert cfg.router_entropy_floor(num_experts=8, topk=2) == pytest.approx(math.log(2))
    assert MechmonConfig(enabled=True, router_min_effective_experts=1.5).router_entropy_floor(8, 1) == pytest.approx(
        math.log(1.5)
    )


def test_floor_above_the_expert_count_fails_at_startup_naming_the_flag(tmp_path):
    site = RouterSite(1, EXPERTS, 2, weight=lambda: torch.eye(EXPERTS, HIDDEN), reduce_sum=lambda v: v, reports=True)
    with pytest.raises(ValueError, match="^router_min_effective_experts is 6, more than the 4 experts"):
        make_session(tmp_path, [], routers=[site], router_min_effective_experts=6)


@pytest.mark.parametrize("interval", [1, 2, 100])
def test_every_interval_gets_a_valid_detector_design(tmp_path, interval):
    layers = [ToyAttention(1, 0)]
    session = make_session(tmp_path, layers, interval=interval, delta=interval)
    run(session, layers, interval * 3)
    assert session.detector is not None and session.errors == 0


def test_bad_calibration_file_fails_at_startup_naming_the_flag(tmp_path):
    bad = tmp_path / "tails.json"
    bad.write_text('{"tails": {"1": {"attn_dw": {"layer": {"u0": 0}}}}}')
    with pytest.raises(ValueError, match="^detector_calibration: no usable null-tail table"):
        make_session(tmp_path, [ToyAttention(1, 0)], detector_calibration=str(bad))


def test_own_calibration_file_is_used(tmp_path):
    import shutil

    from mechmon_megatron.detect.null_model import _TAIL_FILE

    mine = tmp_path / "mine.json"
    shutil.copy(_TAIL_FILE, mine)
    layers = [ToyAttention(1, 0)]
    session = make_session(tmp_path, layers, detector_calibration=str(mine))
    run(session, layers, 10)
    assert session.detector_account.calibration == str(mine)


def test_calibration_without_a_family_fails_at_startup(tmp_path):
    import json as _json

    from mechmon_megatron.detect.null_model import load_tail_table

    table = load_tail_table().to_dict()
    for overlap in table["tails"].values():
        overlap.pop("router_weights")
    path = tmp_path / "partial.json"
    path.write_text(_json.dumps(table))
    with pytest.raises(ValueError, match="^detector_calibration: .*router_weights"):
        make_session(tmp_path, [ToyAttention(1, 0)], detector_calibration=str(path))


def test_families_without_a_signal_are_named_once_and_left_out_of_the_union_bound(tmp_path, caplog):
    layers = [ToyAttention(1, 0), ToyAttention(2, 1)]  # a dense model: no router
    session = make_session(tmp_path, layers)
    with caplog.at_level("WARNING", logger="mechmon_megatron.session.session"):
        run(session, layers, 60)
    session.close()
    lines = [r.getMessage() for r in caplog.records if "left out of the union bound" in r.getMessage()]
    assert len(lines) == 1 and "router_entropy (no MoE router is monitored" in lines[0]
    named = [part.split(" (", 1)[0] for part in lines[0].split("in this job: ", 1)[1].split("; ")]
    assert named == ["router_entropy", "router_weights"]
    account = session.detector_account
    assert set(account.layers) == {"attn_delta2", "attn_dw"} and account.tests == 2 * (2 + 1)
