"""Does a calibration hold on a healthy run it has not seen? Leave one run out.

The check lives in the product (``mechmon_megatron.calibrate.leave_one_out``, ``mechmon-calibrate
--leave-one-out``); the studies (``calibration_variants``) import it from here under the names
they always had.
"""

from __future__ import annotations

from mechmon_megatron.calibrate.fit import TAIL_QUANTILE, schedules
from mechmon_megatron.calibrate.leave_one_out import (
    FoldFit,
    HeldOutRun,
    leave_one_run_out,
    pool_statistics,
    replays_needed,
    shipped_fold_fit,
    summary,
)

__all__ = ["TAIL_QUANTILE", "FoldFit", "HeldOutRun", "leave_one_run_out", "pool_statistics", "replays_needed",
           "schedules", "shipped_fold_fit", "summary"]
