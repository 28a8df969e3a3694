"""The early-phase correction in the session: which calibration and schedule turn it on, the one
line the writer says about it, and that it changes a young baseline's residual by exactly the
phase bin's affine map (the session on plain tensors, attention only)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from mechmon_megatron.detect.null_model import load_tail_table
from mechmon_megatron.detect.phase_moments import TrainingSchedule
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.writers import JsonlScalarWriter, WriterGroup
from tests.session.test_session import ToyAttention, read_jsonl, run

STUDY = TrainingSchedule(100, "cosine", 2e-3)  # the shipped calibration's schedule


def _session(tmp_path, layers, schedule, **overrides) -> MonitoringSession:
    cfg = dict(enabled=True, interval=20, delta=100, log_dir=str(tmp_path), monitors=("attn",))
    cfg.update(overrides)
    writer = WriterGroup([JsonlScalarWriter(str(tmp_path / "scalars.jsonl"))])
    return MonitoringSession(MechmonConfig(**cfg), [layer.site() for layer in layers], writer=writer,
                             schedule=schedule)


def _phase_lines(caplog) -> list[str]:
    return [m for m in (r.getMessage() for r in caplog.records) if m.startswith("[mechmon] detector:") and "phase" in m]


def _run(tmp_path, caplog, schedule, steps=320, **overrides):
    caplog.set_level(logging.INFO, logger="mechmon_megatron.session.session")
    layers = [ToyAttention(1, 0)]
    session = _session(tmp_path, layers, schedule, **overrides)
    run(session, layers, steps)
    detector = session.detector
    session.close()
    return detector, _phase_lines(caplog)


def test_the_shipped_calibration_corrects_a_job_of_its_schedule(tmp_path, caplog):
    detector, lines = _run(tmp_path, caplog, STUDY)
    assert detector is not None and detector.phase is not None
    assert (detector.phase.interval, detector.phase.delta, detector.phase.schedule) == (20, 100, STUDY)
    assert len(lines) == 1 and lines[0].startswith("[mechmon] detector: early-phase correction on: young baselines")
    assert "100-step warm-up, cosine decay, peak learning rate 0.002" in lines[0]


@pytest.mark.parametrize(("schedule", "overrides", "phrase"), [
    (None, {}, "the job's learning-rate schedule is unknown to mechmon: the early-phase correction"),
    (TrainingSchedule(2000, "cosine", 2e-3), {}, "this job has a 2000-step warm-up, cosine decay, peak learning "
                                                 "rate 0.002: the early-phase correction is off"),
    (TrainingSchedule(100, "WSD", 2e-3), {}, "this job has a 100-step warm-up, WSD decay"),
    (TrainingSchedule(100, "cosine", 8e-3), {}, "this job has a 100-step warm-up, cosine decay, peak learning rate "
                                                "0.008: the early-phase correction is off"),
    (TrainingSchedule(100, "cosine"), {}, "the job's peak learning rate is unknown to mechmon: the early-phase "
                                          "correction"),
    (STUDY, {"interval": 5, "delta": 5}, "no phase moments for interval 5 delta 5 (measured: interval 20 delta 100;"),
    (STUDY, {"interval": 100, "delta": 100}, "no phase moments for interval 100 delta 100"),
])
def test_a_job_the_phase_moments_do_not_cover_is_told_once_and_judged_uncorrected(tmp_path, caplog, schedule,
                                                                                   overrides, phrase):
    detector, lines = _run(tmp_path, caplog, schedule, steps=320 if not overrides else 260, **overrides)
    assert detector is not None and detector.phase is None
    assert len(lines) == 1 and phrase in lines[0], lines


def test_a_calibration_file_without_phase_moments_keeps_working_with_one_line(tmp_path, caplog):
    table = load_tail_table().to_dict()
    del table["phase"]
    path = tmp_path / "older.json"
    path.write_text(json.dumps(table))
    detector, lines = _run(tmp_path, caplog, STUDY, detector_calibration=str(path))
    assert detector is not None and detector.phase is None
    assert len(lines) == 1 and "the calibration has no phase moments (a file written before the early-phase " \
                                "correction)" in lines[0] and "refit it with mechmon-calibrate" in lines[0]


def test_a_calibration_file_of_the_first_design_without_a_peak_learning_rate_is_off_with_one_line(tmp_path, caplog):
    table = load_tail_table().to_dict()
    for entry in table["phase"]:
        del entry["peak_lr"]
    path = tmp_path / "first_design.json"
    path.write_text(json.dumps(table))
    detector, lines = _run(tmp_path, caplog, STUDY, detector_calibration=str(path))
    assert detector is not None and detector.phase is None
    assert len(lines) == 1 and "the phase moments do not record their peak learning rate" in lines[0], lines
    assert "refit with mechmon-calibrate --lr" in lines[0]


def test_a_young_baselines_residual_is_the_phase_bins_affine_map_of_the_uncorrected_one(tmp_path):
    """The same toy run with and without the correction: at the first judged check (step 300, a
    baseline of 10 values: young) each layer residual is ``(u - c) / s`` of the bin of steps
    200-399 (the trimmed mean commutes with an increasing affine map; no residual is clipped)."""
    rows = {}
    for name, schedule in (("on", STUDY), ("off", None)):
        layers = [ToyAttention(1, 0)]
        session = _session(tmp_path / name, layers, schedule)
        run(session, layers, 300)
        session.close()
        rows[name] = {r["step"]: r["scalars"] for r in read_jsonl(tmp_path / name / "scalars.jsonl")}
    phase = next(t for t in load_tail_table().phase if (t.interval, t.delta) == (20, 100))
    for family in ("attn_delta2", "attn_dw"):
        key = f"mechmon/detect/{family}/residual/layer_1"
        assert key in rows["on"][300] and key in rows["off"][300]
        b = phase.bin_of(family, 300)
        assert b is not None and b.start == 200
        u_off = rows["off"][300][key]
        assert abs(u_off) < 8 and rows["on"][300][key] == pytest.approx((u_off - b.centre) / b.scale, rel=1e-9)
        assert rows["on"][300][key] != pytest.approx(u_off)


def test_a_latent_attention_job_is_not_corrected_by_moments_of_standard_attention(tmp_path, caplog):
    """The shipped moments come from a grouped-query model; on healthy MLA runs they raised false
    alarms, so a job whose sites are MLA (``AttentionSite.attention``) runs uncorrected."""
    caplog.set_level(logging.INFO, logger="mechmon_megatron.session.session")
    layers = [ToyAttention(1, 0)]
    site = dataclasses.replace(layers[0].site(), attention="mla")
    writer = WriterGroup([JsonlScalarWriter(str(tmp_path / "scalars.jsonl"))])
    session = MonitoringSession(MechmonConfig(enabled=True, interval=20, delta=100, log_dir=str(tmp_path)), [site],
                                writer=writer, schedule=STUDY)
    run(session, layers, 320)
    assert session.detector is not None and session.detector.phase is None
    session.close()
    lines = _phase_lines(caplog)
    assert len(lines) == 1 and "measured on standard attention, this job has mla attention" in lines[0], lines
