"""``session.rollback_reach.MEASURED_LAG_CHECKS`` is what the detector study's committed records
give: the largest (alarm - CUSUM change point) / interval over every alarm at the default rate,
at interval 20 and at interval 100 (every 5th check), replayed from docs/data/detector_study."""

from __future__ import annotations

from pathlib import Path

import pytest

from mechmon_megatron.session.rollback_reach import MEASURED_LAG_CHECKS, change_point_lag

RECORDS = Path(__file__).resolve().parents[3] / "docs" / "data" / "detector_study"


def measured_lags() -> dict[int, list[tuple[str, str, int]]]:
    """interval -> (run, family, checks from the change point to the alarm) per alarm."""
    from mechmon_megatron.research.study.campaign_records import load_records
    from mechmon_megatron.research.study.detector_report import INTERVAL, calibrate, mechmon_sweep

    records = load_records(str(RECORDS))
    table, _ = calibrate(records)
    out = {}
    for every in (1, 5):
        interval = INTERVAL * every
        _, info = mechmon_sweep(records, table, every=every, rates=(0.01,))
        rows = []
        for run, alarms in sorted(info["alarms_at_default_rate"].items()):
            for a in alarms:
                change = a["change_step"] if a["change_step"] is not None else a["step"] - interval
                if a["kind"] == "limit" and a["change_step"] is not None:
                    change -= interval  # its change step is the period's first check, not the check before it
                rows.append((run, a["family"], (a["step"] - change) // interval))
        out[interval] = rows
    return out


@pytest.mark.slow
def test_the_shipped_lag_is_the_largest_measured():
    lags = measured_lags()
    assert all(lags.values()), lags  # the fault runs alarm at both schedules
    assert max(c for rows in lags.values() for _, _, c in rows) == MEASURED_LAG_CHECKS
    assert change_point_lag(20, 100) >= max(c for _, _, c in lags[20]) * 20
