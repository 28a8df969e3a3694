"""Calibration (``mechmon-calibrate``): fit the detector's null tails on a user's healthy runs.

The thresholds of the whole-job detector come from null tails: the exponential tails of its
CUSUM statistics (and per-check residuals) on healthy runs. The package ships tails fitted on
ours (``detect/null_tails.json``); this room fits them on yours, from what a monitored run leaves
behind, and checks them by leaving one run out. One job per file:

* ``inputs``: a command-line path -> one check series per run (``records`` reads
  ``mechmon_scalars.jsonl`` and exported ``.json.gz`` records, ``tensorboard_events`` a run's
  TensorBoard folder);
* ``coverage``: the records' check interval, and whether each family gets statistics at all;
* ``replay``: the detector replayed on recorded checks (alarms, statistics, margins);
* ``fit``: the null statistics and their tail fit, per schedule the file serves;
* ``leave_one_out``: each run replayed under the tails fitted on the others;
* ``cli``: the console script (``main(argv) -> int``), ``progress`` its bar.

Imports: the core, the session, itself, the standard library; ``tensorboard`` and ``tqdm`` only
when used (tests/test_architecture.py). Never megatron, deepspeed or ``research``: the studies
import this room, not the reverse.
"""

from mechmon_megatron.calibrate.errors import CalibrationError
from mechmon_megatron.calibrate.fit import Calibration, calibrate, calibrate_on_runs, schedules
from mechmon_megatron.calibrate.inputs import load_checks, load_named_runs, load_runs
from mechmon_megatron.calibrate.leave_one_out import HeldOutRun, leave_one_run_out, summary

__all__ = ["Calibration", "CalibrationError", "HeldOutRun", "calibrate", "calibrate_on_runs", "leave_one_run_out",
           "load_checks", "load_named_runs", "load_runs", "schedules", "summary"]
