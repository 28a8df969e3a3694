"""Snapshot lifecycle and memory: stale snapshots dropped, one copy for shared rows, the ring for
delta > interval, the start-up budget line and the placement."""

from __future__ import annotations

import logging

import pytest
import torch

from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.session import names
from mechmon_megatron.session.config import MechmonConfig, flag_of
from mechmon_megatron.session.host import AttentionSite, FullQK, QKWeights, SnapshotBudget
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.snapshots import SnapshotStore, resolve_placement
from mechmon_megatron.session.writers import JsonlScalarWriter, WriterGroup
from tests.session.test_session import GROUPS, HEAD_DIM, HEADS, HIDDEN, ToyAttention, read_jsonl

ELEMENTS = (HEADS + GROUPS) * HEAD_DIM * HIDDEN  # one layer's Q + K rows


def _site(layer: ToyAttention, budget: bool = True) -> AttentionSite:
    site = layer.site()
    if budget:
        site.snapshot_budget = SnapshotBudget(ELEMENTS, ELEMENTS, shared=True, element_size=4,
                                              device=torch.device("cpu"))
    return site


def _session(tmp_path, layers, **cfg) -> MonitoringSession:
    config = MechmonConfig(enabled=True, log_dir=str(tmp_path), **cfg)
    writer = WriterGroup([JsonlScalarWriter(str(tmp_path / "scalars.jsonl"))])
    return MonitoringSession(config, [_site(layer) for layer in layers], writer=writer)


def test_snapshot_of_a_skipped_check_step_is_dropped(tmp_path):
    layer = ToyAttention(1, 0)
    session = _session(tmp_path, [layer], interval=5, delta=2)
    session.on_train_start(0)
    for it in range(1, 11):
        layer.step()
        if it == 5:
            continue  # the host skipped this step (DeepSpeed overflow, Megatron skipped iteration)
        session.on_step_end(it)
        if it == 4:
            assert session.snapshots.check_steps() == [5]  # taken after step 3
        if it == 6:
            assert session.snapshots.check_steps() == []  # its check never ran: dropped, not kept
    rows = read_jsonl(tmp_path / "scalars.jsonl")
    # The check at 10 compares with step 8, as scheduled; the one at 5 never ran.
    assert [r["step"] for r in rows if names.attn("delta2_entropy", 1) in r["scalars"]] == [10]
    assert len(session.snapshots) == 0


def test_heads_and_full_matrix_of_one_tensor_are_copied_once():
    layer = ToyAttention(1, 0)
    store = SnapshotStore("cpu")
    site = layer.site()
    heads, full = store.take(site.read_heads(), site.read_full())
    store.put(5, {0: (heads, full)})
    assert store.nbytes() == ELEMENTS * 4  # not twice
    assert heads.wq.untyped_storage().data_ptr() == full.wq.untyped_storage().data_ptr()
    torch.testing.assert_close(heads.wq, layer.wq, rtol=0, atol=0)
    layer.step()  # the snapshot is a copy, not a view of the live weights
    assert not torch.equal(heads.wq, layer.wq)

    # A rank reporting only some heads keeps its own copy.
    part = QKWeights(layer.wq[:2], layer.wk[:1], head_offset=0)
    heads2, full2 = store.take(part, FullQK(layer.wq.reshape(-1, HIDDEN), layer.wk.reshape(-1, HIDDEN)))
    assert heads2.wq.untyped_storage().data_ptr() != full2.wq.untyped_storage().data_ptr()


def test_delta_longer_than_interval_keeps_a_ring_and_logs_the_budget(tmp_path, caplog):
    layer = ToyAttention(1, 0)
    with caplog.at_level(logging.INFO, logger="mechmon_megatron.session.session"):
        session = _session(tmp_path, [layer], interval=5, delta=12)
    expected_mib = 3 * ELEMENTS * 4 / 2**20  # ceil(12 / 5) = 3 sets, one copy per layer each
    assert (f"mechmon: snapshots hold {expected_mib:.4g} MiB on cpu (rank 0; --mechmon-snapshot-device auto; "
            "3 sets held at once (delta 12 > interval 5)") in caplog.text
    held = []
    session.on_train_start(0)
    for it in range(1, 31):
        layer.step()
        session.on_step_end(it)
        held.append(len(session.snapshots))
    assert max(held) == 3
    rows = read_jsonl(tmp_path / "scalars.jsonl")
    key = names.attn("delta2_entropy", 1)
    # The first check with a snapshot 12 steps back is 15 (snapshot after step 3).
    assert [r["step"] for r in rows if key in r["scalars"]] == [15, 20, 25, 30]


def test_pinned_placement_needs_cuda_and_falls_back_with_a_notice(caplog):
    config = MechmonConfig(enabled=True, snapshot_device="pinned")
    with caplog.at_level(logging.WARNING):
        assert resolve_placement(config, 10, torch.device("cpu")) == "cpu"
    assert "needs a CUDA device" in caplog.text
    assert resolve_placement(MechmonConfig(enabled=True), 10, torch.device("cpu")) == "device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_placement_moves_a_large_budget_to_pinned_memory():
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    config = MechmonConfig(enabled=True, snapshot_max_device_share=0.01)
    assert resolve_placement(config, int(0.02 * total), device) == "pinned"
    assert resolve_placement(config, int(0.005 * total), device) == "device"
    store = SnapshotStore("pinned")
    w = torch.randn(64, 32, device=device)
    copy = store.copy(w)
    torch.cuda.synchronize()
    assert copy.is_pinned() and torch.equal(copy.to(device), w)


@pytest.mark.parametrize("overrides,flag", [
    ({"snapshot_max_device_share": 0.0}, "--mechmon-snapshot-max-device-share"),
    ({"snapshot_device": "gpu"}, "--mechmon-snapshot-device"),
    ({"full_matrix_method": "svd"}, "--mechmon-full-matrix-method"),
    ({"full_matrix_rank": 0}, "--mechmon-full-matrix-rank"),
    ({"wq_norm_power_iters": -1}, "--mechmon-wq-norm-power-iters"),
])
def test_bad_snapshot_and_full_matrix_settings_name_their_flag(overrides, flag):
    with pytest.raises(ConfigError) as caught:
        MechmonConfig(enabled=True, **overrides)
    assert caught.value.field == next(iter(overrides))
    assert caught.value.render(flag_of).startswith(f"{flag} ")


def test_a_budget_that_cannot_fit_names_the_flags():
    from mechmon_megatron.session.snapshots import host_memory_bytes

    config = MechmonConfig(enabled=True, interval=10, delta=30)
    with pytest.raises(ValueError, match=r"--mechmon-delta \(now 30; 3 snapshot sets.*--mechmon-no-full-matrix-dw"):
        resolve_placement(config, host_memory_bytes(), torch.device("cpu"))


def test_shared_rows_are_found_from_memory_without_reading_the_values(monkeypatch):
    """The aliasing check compares storages, never values: no torch.equal (a device sync per
    snapshot on an accelerator); equal values in different memory get their own copy."""
    layer = ToyAttention(1, 0)
    store = SnapshotStore("cpu")

    def no_value_comparison(*args, **kwargs):
        raise AssertionError("torch.equal called while taking a snapshot")

    monkeypatch.setattr(torch, "equal", no_value_comparison)
    site = layer.site()
    heads, full = store.take(site.read_heads(), site.read_full())  # views of one tensor: one copy
    assert heads.wq.data_ptr() == full.wq.data_ptr() and heads.wk.data_ptr() == full.wk.data_ptr()
    twin = QKWeights(layer.wq.clone(), layer.wk.clone(), head_offset=0)  # equal values, other memory
    heads2, full2 = store.take(twin, site.read_full())
    assert heads2.wq.data_ptr() != full2.wq.data_ptr()
    monkeypatch.undo()
    assert torch.equal(heads2.wq, heads.wq) and torch.equal(full2.wq, full.wq)
