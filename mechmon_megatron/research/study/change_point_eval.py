"""How well do change-point estimates date the onset of the FA faults? Design data only.

Reads ONLY the committed records of ``docs/data/detector_study``, ``docs/data/short_window_study``
and ``docs/data/fa_s8_study`` (never ``runs/``: those hold the pre-registered held-out records).
Each FA fault run (``fa-s<ulps>-on<onset>[-layers2]-seed<k>``) is replayed through the shipped
detector at interval 20 exactly as ``shipped_replay.replay_shipped`` does (same checks, tails,
thresholds and misfit setting), here with a loop that also keeps the pooled residuals. Its first
alarm at or after the onset is taken (runs with earlier, false alarms are counted; the path then
starts after the restart they caused) and the residual path ``u`` of the test that fired:

* layer level: the layer's pooled residual ``"<family>/residual/layer_L"``;
* family level: the trimmed mean (the config's trim, 0.25) of the family's layer residuals at the
  checks where the family CUSUM ran, exactly the detector's ``u_F``.

The path runs from the test's first check (since its last restart) to the alarm check, inclusive.
On it: the CUSUM last zero (checked against the alarm's own ``change_step``, mismatches reported),
the mean-shift and the ramp maximum-likelihood estimates (``research.study.change_point``), on the whole
path and on trailing windows (the last 50 / 25 checks). Per cell (ulps x onset; each record
directory and pooled): the share with ``|change_step - onset| <= 100`` (one delta), the median
and range of ``change_step - onset`` (steps). A None estimate (shift fitted from the path's or
window's first check) counts as a miss. Prints a markdown table and then JSON.

    nice -n 10 python -m mechmon_megatron.research.study.change_point_eval [--calibration FILE]

``--calibration``: a tail table other than the shipped one (its phase moments apply where they
match the record's schedule, as in ``replay_shipped``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from mechmon_megatron.calibrate.replay import CORE_FAMILIES, subsample, thresholds_at_rate
from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, TailTable, load_tail_table
from mechmon_megatron.detect.pooled_cusum import (
    PooledAlarm,
    PooledCusumDetector,
    default_sequential_config,
    trimmed_mean,
)
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.campaign_records import load_records
from mechmon_megatron.research.study.change_point import cusum_last_zero, mean_shift_change_point, ramp_change_point
from mechmon_megatron.research.study.shipped_replay import (
    RECORDED_DELTA,
    RECORDED_INTERVAL,
    only_families,
    record_phase,
    replay_shipped,
)
from mechmon_megatron.session.detector_inputs import observations_from_scalars

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
DESIGN_DIRS = ("docs/data/detector_study", "docs/data/short_window_study", "docs/data/fa_s8_study")
"""The only records read (design data)."""
FA_RUN = re.compile(r"^fa-s(?P<ulps>\d+)-on(?P<onset>\d+)(?P<variant>-layers2)?-seed\d+$")
WINDOWS: tuple[Optional[int], ...] = (None, 50, 25)
"""Trailing windows (checks) the estimators also see; None: the whole path."""
ESTIMATORS = ("alarm", "cusum", "mean_shift", "ramp")
"""``alarm``: the shipped alarm's own change_step; the others recomputed on the path."""
Path = list[tuple[int, float, Optional[int]]]
"""(step, u, previous check's step) of one test since its last restart."""


def first_alarm_path(record: CampaignRecord, table: TailTable) -> tuple[Optional[PooledAlarm], Path, int]:
    """The first alarm at or after the onset, its test's residual path, and the alarms before the onset."""
    onset = record.run.fault_onset or 0
    checks = subsample(only_families(record.data.checks, CORE_FAMILIES), RECORDED_INTERVAL, 1)
    overlap = max(1, -(-RECORDED_DELTA // RECORDED_INTERVAL))
    thresholds, account = thresholds_at_rate(checks, RECORDED_INTERVAL, overlap, DEFAULT_FALSE_ALARM_RATE, table)
    config = default_sequential_config(RECORDED_INTERVAL)
    phase = record_phase(record, table)
    det = PooledCusumDetector(thresholds, config, warning_probability=account.warning_per_test_check_probability,
                              phase=phase)
    paths: dict[tuple[str, Optional[int]], Path] = {}  # (family, layer or None for the family test)
    previous: Optional[int] = None
    early = 0
    for step, scalars in checks:
        res = det.update(step, observations_from_scalars(scalars))
        layer_u: dict[str, list[float]] = {}
        for key, value in res.statistics.items():
            family, kind, *rest = key.split("/")
            if kind == "residual":
                paths.setdefault((family, int(rest[0].rsplit("_", 1)[1])), []).append((step, value, previous))
                layer_u.setdefault(family, []).append(value)
        for family, us in layer_u.items():
            if f"{family}/cusum" in res.statistics:  # the family CUSUM ran: it pools the layers' u
                paths.setdefault((family, None), []).append((step, trimmed_mean(us, config.trim), previous))
        previous = step
        for alarm in res.alarms:
            test = (alarm.family, alarm.layers[0] if alarm.level == "layer" else None)
            if step >= onset:
                return alarm, list(paths.get(test, [])), early
            early += 1
        for alarm in res.alarms:  # restarts, as the detector does them
            for test in list(paths):
                if test[0] == alarm.family and (alarm.level == "family" or test[1] in alarm.layers):
                    del paths[test]
    return None, [], early


def estimates(path: Path, window: Optional[int]) -> dict[str, Optional[int]]:
    """The three change-point estimates on the path (its trailing ``window`` checks)."""
    part = path if window is None else path[-window:]
    steps, u = [p[0] for p in part], [p[1] for p in part]
    return {"cusum": cusum_last_zero(steps, u, 1.0, part[0][2]) if part else None,
            "mean_shift": mean_shift_change_point(steps, u), "ramp": ramp_change_point(steps, u)}


def evaluate_run(directory: str, record: CampaignRecord, table: TailTable) -> dict[str, Any]:
    """One fault run: its first alarm, the estimates, and the agreement checks."""
    alarm, path, early = first_alarm_path(record, table)
    onset = record.run.fault_onset or 0
    row: dict[str, Any] = {"dir": os.path.basename(directory), "run": record.run.run_id, "onset": onset,
                           "alarms_before_onset": early, "alarm": None}
    shipped = [a for a in replay_shipped(record, table=table).alarms if a["step"] >= onset]
    if alarm is None:
        row["replay_agrees"] = not shipped
        return row
    row["alarm"] = {"step": alarm.step, "family": alarm.family, "level": alarm.level, "kind": alarm.kind,
                    "layers": list(alarm.layers), "change_step": alarm.change_step, "path_checks": len(path)}
    first = shipped[0] if shipped else {}
    row["replay_agrees"] = all(first.get(k) == row["alarm"][k] for k in ("step", "family", "level", "change_step"))
    row["estimates"] = {str(w or "all"): {"alarm": alarm.change_step, **estimates(path, w)} for w in WINDOWS}
    row["cusum_matches_alarm"] = row["estimates"]["all"]["cusum"] == alarm.change_step
    # Checks at which the test had no value (e.g. a fork's first windows without the 100-step streams):
    # the detector's last zero is then the previous *check*, the path's the previous *value*.
    row["path_gaps"] = sum(p[2] != q[0] for q, p in zip(path, path[1:]))
    return row


def summary(rows: Sequence[dict[str, Any]], pick: Callable[[dict[str, Any]], Optional[int]]) -> dict[str, Any]:
    """Share within one delta, median and range of (estimate - onset) over the runs with an alarm."""
    errs = [None if (e := pick(r)) is None else e - r["onset"] for r in rows if r["alarm"]]
    known = np.array([e for e in errs if e is not None], dtype=float)
    hits = sum(e is not None and abs(e) <= RECORDED_DELTA for e in errs)
    return {"n": len(errs), "within": hits, "share": hits / len(errs) if errs else float("nan"),
            "none": sum(e is None for e in errs),
            "median": float(np.median(known)) if known.size else None,
            "min": float(known.min()) if known.size else None, "max": float(known.max()) if known.size else None}


def _pick(window: str, estimator: str) -> Callable[[dict[str, Any]], Optional[int]]:
    return lambda row: row["estimates"][window][estimator]


def cell_of(run_id: str) -> str:
    m = FA_RUN.match(run_id)
    assert m is not None
    return f"s{m['ulps']}-on{m['onset']}{m['variant'] or ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description="change-point estimates on the design records")
    parser.add_argument("--calibration", default=None, help="a tail table (default: the shipped one)")
    table = load_tail_table(parser.parse_args().calibration)
    rows = []
    for rel in DESIGN_DIRS:
        directory = os.path.normpath(os.path.join(_ROOT, rel))
        for run_id, record in load_records(directory).items():
            if FA_RUN.match(run_id) and not record.healthy:
                rows.append(evaluate_run(directory, record, table))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        for d in (r["dir"], "pooled"):
            groups.setdefault((d, cell_of(r["run"])), []).append(r)
    table = []
    print("| records | cell | runs (alarmed) | estimator | within ±100 | median | range | None |")
    print("|---|---|---|---|---|---|---|---|")
    for (d, cell), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] == "pooled", kv[0])):
        for w in WINDOWS:
            for est in ESTIMATORS:
                s = summary(rs, _pick(str(w or "all"), est))
                table.append({"records": d, "cell": cell, "runs": len(rs), "estimator": est, "window": w or "all", **s})
                if w is not None:  # the windows are summarised below (printed only where they differ)
                    continue
                rng = "-" if s["min"] is None else f"{s['min']:+.0f} .. {s['max']:+.0f}"
                med = "-" if s["median"] is None else f"{s['median']:+.0f}"
                print(f"| {d} | {cell} | {len(rs)} ({s['n']}) | {est} | {s['within']}/{s['n']} "
                      f"({100 * s['share']:.0f} %) | {med} | {rng} | {s['none']} |")
    for w in WINDOWS[1:]:
        # LLR(tau) depends on u[tau:] only (and the CUSUM forgets before its last zero), so a trailing
        # window changes an estimate only where the whole path's maximiser lies before the window.
        changed = {e: [r["run"] for r in rows if r["alarm"] and r["estimates"][str(w)][e] != r["estimates"]["all"][e]]
                   for e in ESTIMATORS[1:]}
        print(f"trailing {w} checks: estimates that differ from the whole path's: {changed}")
    checks = {"cusum_mismatches": [f"{r['dir']}/{r['run']} (path gaps: {r['path_gaps']})"
                                 for r in rows if r["alarm"] and not r["cusum_matches_alarm"]],
              "replay_disagreements": [r["run"] for r in rows if not r["replay_agrees"]],
              "no_alarm_after_onset": [f"{r['dir']}/{r['run']}" for r in rows if not r["alarm"]],
              "runs_with_alarms_before_onset": [f"{r['dir']}/{r['run']}" for r in rows if r["alarms_before_onset"]],
              "alarm_levels": {lv: sum(1 for r in rows if r["alarm"] and r["alarm"]["level"] == lv)
                               for lv in ("layer", "family")}}
    print(json.dumps({"checks": checks, "table": table, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
