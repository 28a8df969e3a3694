"""The start-up line's arm step is the step of the first ``mechmon/detect/*`` scalar (the session on
plain tensors, attention only: values from the first check with a snapshot ``delta`` steps old)."""

from __future__ import annotations

import logging
import re

import pytest

from tests.session.test_session import ToyAttention, make_session, read_jsonl, run


@pytest.mark.parametrize(("interval", "delta", "step"), [
    (5, 5, 5 + 40 * 5),     # warm-up max(5, ceil(200 / 5)) = 40 checks
    (20, 60, 60 + 10 * 20),  # 10 checks after the first check with a 60-step-old snapshot
    (7, 10, 14 + 29 * 7),    # the first check with a snapshot 10 steps old is 14
])
def test_the_predicted_arm_step_is_the_first_detector_statistic(tmp_path, caplog, interval, delta, step):
    caplog.set_level(logging.INFO, logger="mechmon_megatron.session.session")
    layers = [ToyAttention(1, 0)]
    session = make_session(tmp_path, layers, interval=interval, delta=delta)
    run(session, layers, step + interval)
    session.close()
    said = [r.getMessage() for r in caplog.records if "detector arms at step" in r.getMessage()]
    assert len(said) == 1 and int(re.search(r"at step (\d+):", said[0]).group(1)) == step, said
    rows = read_jsonl(tmp_path / "scalars.jsonl")
    first = next(r["step"] for r in rows if any(k.startswith("mechmon/detect/") for k in r["scalars"]))
    assert first == step
    armed = [r.getMessage() for r in caplog.records if "detector armed at step" in r.getMessage()]
    assert armed == [f"[mechmon] detector armed at step {step} (first mechmon/detect/* statistics: attn_delta2, "
                     "attn_dw)"]


def test_a_resume_names_the_checks_that_wait_for_a_window(tmp_path, caplog):
    """The snapshots are not in the checkpoint: after a resume at 200 (interval 20, delta 100), the
    checks at 220-280 have no Delta2/dW, the one at 300 has; one start-up line says so, and the
    records agree."""
    caplog.set_level(logging.INFO, logger="mechmon_megatron.session.session")
    layers = [ToyAttention(1, 0)]
    first = make_session(tmp_path / "a", layers, interval=20, delta=100)
    run(first, layers, 200)
    state = first.state_dict()
    first.close()
    resumed = make_session(tmp_path / "b", layers, interval=20, delta=100)
    resumed.load_state_dict(state)
    run(resumed, layers, 120, start=200)
    resumed.close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[mechmon] resumed at step")]
    assert len(said) == 1 and "checks at steps 220-280 have no window yet" in said[0] and "at step 300" in said[0]
    attention = [r["step"] for r in read_jsonl(tmp_path / "b" / "scalars.jsonl")
                 if any(k.startswith("mechmon/attn/") for k in r["scalars"])]
    assert attention and min(attention) == 300


def test_a_fresh_start_says_nothing_of_a_resume(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mechmon_megatron.session.session")
    layers = [ToyAttention(1, 0)]
    session = make_session(tmp_path, layers, interval=20, delta=100)
    run(session, layers, 120)
    session.close()
    assert not [r for r in caplog.records if "resumed at step" in r.getMessage()]
