"""mechmon's one checkpoint format: a Stateful session under one "mechmon" key; old layouts load."""

from __future__ import annotations

import logging

import pytest
from torch.distributed.checkpoint.stateful import Stateful

from mechmon_megatron.session import state_format
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.state_format import STATE_KEY, state_of

STATE = {"version": 2, "detector": None, "checkpoints": [{"iteration": 4, "path": "x"}], "errors": 3}


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
