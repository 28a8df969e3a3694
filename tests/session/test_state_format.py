"""mechmon's one checkpoint format: a Stateful session under one "mechmon" key; old layouts load."""

from __future__ import annotations

import logging

import pytest
from torch.distributed.checkpoint.stateful import Stateful

from mechmon_megatron.session import state_format
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.state_format import PER_RANK_FORMAT, STATE_KEY, own_state, per_rank, state_of

STATE = {"version": 2, "interval": 100, "delta": 100, "detector": None, "checkpoints": [{"iteration": 4, "path": "x"}],
         "errors": 3}


def test_the_session_is_a_stateful_object_whose_state_round_trips():
    session = MonitoringSession(MechmonConfig(enabled=True))
    assert isinstance(session, Stateful)
    session.load_state_dict(STATE)
    assert session.state_dict() == STATE and session.errors == 3
    again = MonitoringSession(MechmonConfig(enabled=True))
    again.load_state_dict(state_of({STATE_KEY: session.state_dict(), "user": 1}, "ckpt"))
    assert again.state_dict() == STATE


def test_old_example_trainer_layout_loads_with_one_notice(caplog):
    state_format._noticed.discard("trainer-callbacks")
    old = {"callbacks": {STATE_KEY: STATE, "recorder": {}}, "iteration": 4}
    with caplog.at_level(logging.WARNING):
        assert state_of(old, "ckpt A") == STATE
        assert state_of(old, "ckpt B") == STATE
    notices = [r.getMessage() for r in caplog.records if "older format" in r.getMessage()]
    assert len(notices) == 1 and "ckpt A" in notices[0] and "callbacks/mechmon" in notices[0]


def test_missing_and_malformed_state():
    assert state_of(None, "x") is None and state_of({}, "x") is None and state_of({"other": 1}, "x") is None
    with pytest.raises(ValueError, match=r"ckpt: the 'mechmon' entry is a list"):
        state_of({STATE_KEY: [1]}, "ckpt")


def test_per_rank_entry_gives_each_rank_its_own_and_the_single_state_loads_with_one_notice(caplog):
    entry = per_rank({0: STATE, 1: {**STATE, "errors": 5}})
    assert own_state(entry, 1, "ckpt") == {**STATE, "errors": 5} and own_state(entry, 0, "ckpt") == STATE
    with caplog.at_level(logging.WARNING):
        assert own_state(entry, 2, "ckpt") is None  # the job grew: that rank starts afresh, said once
    assert any("no mechmon state of rank 2" in r.getMessage() for r in caplog.records)
    state_format._noticed.discard("deepspeed-single")
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the older layout: the saving rank's state, on every rank
        assert own_state(STATE, 0, "old A") == STATE and own_state(STATE, 1, "old B") == STATE
    notices = [r.getMessage() for r in caplog.records if "older format" in r.getMessage()]
    assert len(notices) == 1 and "old A" in notices[0] and "saving rank only" in notices[0]
    assert own_state(None, 0, "x") is None
    with pytest.raises(ValueError, match="no per-rank states"):
        own_state({"format": PER_RANK_FORMAT, "ranks": [STATE]}, 0, "ckpt")
