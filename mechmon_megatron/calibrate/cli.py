"""``mechmon-calibrate RUN... --interval N --delta N --out tails.json``: fit the detector's null
tails on your own healthy runs (the shipped default came from ours).

Exit codes: 0 the tails were fitted (and written with ``--out``); 2 bad input or flags: a path
without records, records of another interval, runs too short to fit a family, an ``--out`` that
exists (without ``--force``) or is a folder, fewer than 3 runs for ``--leave-one-out``. The
message is one line naming the path, family or flag, and nothing is written (a ``--leave-one-out``
that fails after the fit leaves the fitted table in ``--out``: the check failed, not the fit).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from mechmon_megatron.calibrate.errors import CalibrationError
from mechmon_megatron.calibrate.fit import calibrate, fit_replays
from mechmon_megatron.calibrate.inputs import load_named_runs, run_name
from mechmon_megatron.calibrate.leave_one_out import leave_one_run_out, replays_needed, summary
from mechmon_megatron.calibrate.progress import progress_bar
from mechmon_megatron.calibrate.replay import Checks
from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, TailTable
from mechmon_megatron.detect.phase_moments import TrainingSchedule
from mechmon_megatron.session.schedule_flags import add_schedule_flags, schedule_from_args

__all__ = ["CalibrateConfig", "build_parser", "main"]

PROG = "mechmon-calibrate"

DESCRIPTION = """\
Fit the detector's null tails on your own healthy runs, recorded with --mechmon-per-head-scalars.

Each RUN is a run's --mechmon-log-dir (it holds mechmon_scalars.jsonl), the run folder above it
(RUN/mechmon/mechmon_scalars.jsonl), the mechmon_scalars.jsonl file, a record exported by the
detector study (.json.gz), or the run's TensorBoard folder (mechmon/... scalars; stored as
float32, so prefer the JSONL records when you have them). A records file that holds several fresh
starts gives one run each (#runK in the names); a resume continues its run.

The runs are replayed without alarms, the CUSUM values of every test are collected and their
exponential tails fitted, and so are the per-check pooled residuals (the `shewhart` section that
--mechmon-detector-shewhart needs). With the runs' learning-rate schedule (--lr-warmup-iters,
--lr-decay-style and --lr, as the runs were launched), the phase moments of young baselines are measured
first (the `phase` section: the early-phase correction of jobs with that schedule) and the tails
are fitted on replays that apply them; without it the file has no `phase` section and jobs that
use it judge young baselines uncorrected. Use the file with --mechmon-detector-calibration FILE
(DeepSpeed: detector_calibration; mechmon-scan: --detector-calibration).

--leave-one-out (three runs or more) also fits on all runs but one and replays the detector at
--rate on the one left out, for each run and both schedules the file serves: a held-out alarm is
a false alarm that this calibration would not have prevented, and the closest approach to a
warning level says how much room the quiet runs had. Prints a JSON summary.
"""


@dataclass(kw_only=True, frozen=True, slots=True)
class CalibrateConfig:
    """One ``mechmon-calibrate`` command, checked before any run is read."""

    runs: tuple[str, ...]
    """Healthy runs (paths; see ``calibrate.inputs`` for the forms)."""
    interval: int
    """``--mechmon-interval`` the runs were recorded with (steps between checks)."""
    delta: int
    """``--mechmon-delta`` the runs were recorded with (steps of the increment window)."""
    out: Optional[str] = None
    """Where the tail table (JSON) goes; None: print the summary only."""
    force: bool = False
    """Overwrite an existing ``out``."""
    leave_one_out: bool = False
    """Also replay each run under the tails fitted on the others (3 runs or more)."""
    rate: float = DEFAULT_FALSE_ALARM_RATE
    """False alarms per 10^6 steps of the leave-one-out replays (the session's default)."""
    schedule: Optional[TrainingSchedule] = None
    """The runs' learning-rate schedule; given, the phase moments are fitted (``detect.phase_moments``)."""

    def __post_init__(self) -> None:
        for flag, value in (("--interval", self.interval), ("--delta", self.delta)):
            if value < 1:
                raise CalibrationError(f"{flag} must be >= 1 (steps), got {value}")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise CalibrationError(f"--rate must be a finite number > 0 (false alarms per 10^6 steps), got {self.rate}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="healthy runs: log dirs, run folders, mechmon_scalars.jsonl, .json.gz records, "
                        "TensorBoard folders")
    p.add_argument("--interval", type=int, required=True,
                   help="the --mechmon-interval the runs were recorded with (steps)")
    p.add_argument("--delta", type=int, required=True,
                   help="the --mechmon-delta the runs were recorded with (steps)")
    p.add_argument("--out", default=None, help="where to write the tail table (JSON); default: print the summary only")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.add_argument("--leave-one-out", action="store_true",
                   help="also replay each run with the tails of the others (needs at least 3 runs)")
    p.add_argument("--rate", type=float, default=DEFAULT_FALSE_ALARM_RATE,
                   help="false alarms per 10^6 steps for --leave-one-out (the session default)")
    add_schedule_flags(p, "the runs'")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script: 0 fitted, 2 bad input (one line on stderr, see the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        config = CalibrateConfig(runs=tuple(args.runs), interval=args.interval, delta=args.delta, out=args.out,
                                 force=args.force, leave_one_out=args.leave_one_out, rate=args.rate,
                                 schedule=schedule_from_args(args, CalibrationError))
        result = _run(config)
    except CalibrationError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


def _check_out(out: Optional[str], force: bool) -> None:
    """Refuse an ``--out`` that cannot be written before any work is done."""
    if out is None:
        return
    if os.path.isdir(out):
        raise CalibrationError(f"--out {out}: is a folder; name the tail table's file, e.g. "
                               f"{os.path.join(out, 'tails.json')}")
    if os.path.exists(out) and not force:
        raise CalibrationError(f"--out {out}: the file exists; pass --force to overwrite it, or choose another path")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CalibrationError(f"--out {out}: the folder {parent} does not exist")


def _write(out: str, table: TailTable) -> None:
    """Write through a temporary file in the same folder, so an interrupted write leaves no half table."""
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(table.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, out)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise CalibrationError(f"--out {out}: cannot be written ({exc.strerror or exc})") from None


def _run(config: CalibrateConfig) -> dict[str, Any]:
    _check_out(config.out, config.force)
    series, names = load_named_runs(config.runs, run_name)  # a file of several fresh starts: one series each
    if config.leave_one_out and len(series) < 3:
        raise CalibrationError(
            f"--leave-one-out needs at least 3 healthy runs (2 to fit, 1 to hold out), got {len(series)}")
    bar = progress_bar(fit_replays(len(series), config.interval, config.delta, phase=config.schedule is not None),
                       "fit")
    source = f"{len(series)} healthy runs, interval {config.interval}, delta {config.delta}"
    if config.schedule is not None:
        source += f", {config.schedule.describe()}"
    try:
        fitted = calibrate(series, names, config.interval, config.delta, source=source,
                           on_replay=bar.update if bar is not None else None, schedule=config.schedule)
    finally:
        if bar is not None:
            bar.close()
    for note in fitted.notes:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    if config.out:
        _write(config.out, fitted.table)
    result: dict[str, Any] = {"out": config.out, "runs": len(series), "checks": sum(len(s) for s in series),
                              "fit": fitted.log}
    if fitted.notes:
        result["notes"] = list(fitted.notes)
    if config.leave_one_out:
        result["leave_one_out"] = _leave_one_out(series, names, config)
    return result


def _leave_one_out(series: Sequence[Checks], names: Sequence[str], config: CalibrateConfig) -> dict[str, Any]:
    bar = progress_bar(replays_needed(len(series), config.interval, config.delta, phase=config.schedule is not None),
                       "leave-one-out")
    try:
        held = leave_one_run_out(series, names, config.interval, config.delta, config.rate,
                                 on_replay=bar.update if bar is not None else None, schedule=config.schedule)
    except ValueError as exc:
        raise CalibrationError(f"--leave-one-out failed: {exc}") from None
    finally:
        if bar is not None:
            bar.close()
    return {"rate": config.rate, "summary": summary(held), "runs": [asdict(h) for h in held]}
