"""The start-up reach check: the change-point lag at a schedule, and the one line that says when
the saves kept at an alarm cannot include one at or before the change point."""

from __future__ import annotations

from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.rollback_reach import (
    DEFAULT_DELTA,
    DEFAULT_INTERVAL,
    MEASURED_LAG_CHECKS,
    change_point_lag,
    reach,
    reach_notice,
)
from mechmon_megatron.supervise.cli import reachability_notices


def test_defaults_are_the_sessions():
    config = MechmonConfig()
    assert (DEFAULT_INTERVAL, DEFAULT_DELTA) == (config.interval, config.delta)


def test_lag_grows_with_the_interval_and_the_window():
    lag20 = change_point_lag(20, 100)
    assert lag20 == MEASURED_LAG_CHECKS * 20 + 80
    assert change_point_lag(100, 100) == MEASURED_LAG_CHECKS * 100
    r = reach(100, 20, 100)
    assert r.lag == lag20 and r.discarded_at_most == lag20 + 100 and r.keep_needed == -(-lag20 // 100) + 2


def test_notice_names_the_flags_only_when_the_retention_is_too_short():
    r = reach(100, 20, 100)
    assert reach_notice(100, r.keep_needed, "--keep-last-n-checkpoints", 20, 100) is None
    assert reach_notice(100, None, None, 20, 100) is None  # no retention: every save is kept
    line = reach_notice(100, 1, "--keep-last-n-checkpoints", 20, 100)
    assert line is not None
    for flag in ("--keep-last-n-checkpoints 1", "--save-interval 100", "--mechmon-interval 20", "--mechmon-delta 100"):
        assert flag in line, line
    assert f"keep at least {r.keep_needed} checkpoints" in line


def test_supervisor_start_up_line():
    base = ["--mechmon", "--mechmon-action", "checkpoint-and-abort", "--save", "ck", "--save-interval", "100",
            "--mechmon-interval", "20", "--mechmon-delta", "100"]
    assert reachability_notices(base) == []
    notices = reachability_notices([*base, "--keep-last-n-checkpoints", "1"])
    assert len(notices) == 1 and "rollback cannot reach the change point" in notices[0]
    assert any("--save-interval" in n for n in reachability_notices(base[:5]))
