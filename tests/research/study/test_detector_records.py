"""The detector study's committed records (docs/data/detector_study): the shipped calibration is
reproducible from them (its tails and its phase moments), and the healthy runs stay quiet at the
default false-alarm rate with the correction the session applies to each run's schedule."""

import json
import os

import pytest

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, load_tail_table
from mechmon_megatron.detect.phase_moments import TrainingSchedule, select_phase_table
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.detector_report import CALIBRATION_RUNS, DELTA, INTERVAL
from mechmon_megatron.research.study.pooled_replay import calibrate_on_runs, replay_pooled, thresholds_at_rate
from mechmon_megatron.research.study.shipped_replay import record_schedule
from mechmon_megatron.session.detector_inputs import attention_kind

RECORDS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "data", "detector_study")

pytestmark = pytest.mark.skipif(not os.path.isdir(RECORDS), reason="docs/data/detector_study not present")


@pytest.fixture(scope="module")
def records():
    return load_records(RECORDS)


def test_the_healthy_runs_cover_whole_schedules(records):
    healthy = {k: r for k, r in records.items() if r.healthy}
    assert sum(1 for r in healthy.values() if r.run.schedule == "cosine" and r.data.steps[-1] == 10_000) >= 3
    assert any(r.run.schedule == "wsd" and r.data.steps[-1] == 10_000 for r in healthy.values())
    assert any(r.run.interrupt_at for r in healthy.values())
    for record in healthy.values():
        assert record.data.steps == list(range(1, record.data.steps[-1] + 1))  # every step once


def test_shipped_null_tails_are_the_fit_of_the_calibration_runs(records):
    schedule = record_schedule(records[CALIBRATION_RUNS[0]])
    assert schedule == TrainingSchedule(100, "cosine", 2e-3)  # the flags of the calibration runs
    table, _ = calibrate_on_runs([records[r].data.checks for r in CALIBRATION_RUNS], INTERVAL, DELTA, shewhart=True,
                                 schedule=schedule)
    shipped = json.loads(json.dumps(load_tail_table().to_dict()))
    assert table.to_dict()["tails"] == shipped["tails"]
    assert table.to_dict()["shewhart"] == shipped["shewhart"]  # the --mechmon-detector-shewhart tails
    assert table.to_dict()["phase"] == shipped["phase"]  # the early-phase correction


def _phase(record):
    return select_phase_table(load_tail_table().phase, INTERVAL, DELTA, record_schedule(record),
                              attention_kind(record.data.checks))[0]


def test_no_alarm_on_any_healthy_run_at_the_default_rate(records):
    table = load_tail_table()
    for run_id, record in records.items():
        if not record.healthy:
            continue
        checks = record.data.checks
        thresholds, _ = thresholds_at_rate(checks, INTERVAL, DELTA // INTERVAL, DEFAULT_FALSE_ALARM_RATE, table)
        replay = replay_pooled(checks, thresholds, default_sequential_config(INTERVAL), phase=_phase(record))
        assert not replay.alarms, (run_id, replay.alarms[:3])


def test_fa_faults_alarm_after_their_onset(records):
    table = load_tail_table()
    for run_id, record in records.items():
        if record.run.scenario != "fa" or record.run.fa_strength != 32.0:
            continue
        checks = record.data.checks
        thresholds, _ = thresholds_at_rate(checks, INTERVAL, DELTA // INTERVAL, DEFAULT_FALSE_ALARM_RATE, table)
        replay = replay_pooled(checks, thresholds, default_sequential_config(INTERVAL), phase=_phase(record))
        first = min(a.step for a in replay.alarms if a.family.startswith("attn"))
        assert record.run.fault_onset < first, run_id
