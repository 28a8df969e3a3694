"""Replay the whole-job detector on recorded runs: first alarms, null statistics, calibration.

The replay and the fit live in the product (``mechmon_megatron.calibrate``: ``replay`` and
``fit``), which ``mechmon-calibrate`` runs for users; the studies import them from here under the
names they always had.
"""

from __future__ import annotations

from mechmon_megatron.calibrate.fit import (
    calibrate_on_runs,
    fit_levels,
    fit_tail_table,
    null_residuals,
    null_statistics,
)
from mechmon_megatron.calibrate.replay import (
    CORE_FAMILIES,
    FAMILIES,
    Checks,
    PooledReplay,
    never_thresholds,
    proxy_shape,
    replay_pooled,
    subsample,
    thresholds_at_rate,
)

__all__ = [
    "CORE_FAMILIES", "FAMILIES", "Checks", "PooledReplay", "calibrate_on_runs", "fit_levels", "fit_tail_table",
    "never_thresholds", "null_residuals", "null_statistics", "proxy_shape", "replay_pooled", "subsample",
    "thresholds_at_rate",
]
