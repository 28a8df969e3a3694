"""Issue 19, round 6: the shipped detector (``long``) against ``long+logit``, the same detector plus
one per-step test of attention logit growth, at the SAME false-alarm rate, on the records of the
short-window campaign (pre-registered in docs/RESULTS.md, "Attention logit growth read every step").

- ``attn_logit``: every step, ``log`` of the job-wide maximum attention logit (the records' per-step
  ``max_attn_logit``, megatron-core's ``--log-max-attention-logit`` value), through the product's
  detector code at its interval-1 settings (``design_study.logit_config(1)``: a robust line through
  the last 200 accepted steps, warm-up 200 steps, residual clipped to 8, CUSUM reference 1). The
  stream runs in the slot of a rising family, as in the round-2 design study (research only:
  the product has no per-step family yet).
- Union bound over ``N + 1`` tests: every check test gets ``R / ((N + 1) C)``, the per-step test
  ``R / ((N + 1) 10^6)``.
- Null tails (check families and the per-step CUSUM) fitted on the calibration runs only.

Round 7 (``long+logit5``, docs/RESULTS.md, "Round 7"): the same design with the per-step tail
fitted on named healthy runs (``logit_tail_records``: the five 10,000-step healthy runs that exist
today), and a leave-one-out check of that tail (:func:`leave_one_out`). The check families keep
their calibration-run tails.

Needs numpy (the max-logit rule's scores).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, NullTail, fit_null_tail, thresholds_for_job
from mechmon_megatron.detect.pooled_cusum import FamilyThresholds, Thresholds, default_sequential_config
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.design_study import earliest_alarm, logit_config, logit_replay
from mechmon_megatron.research.study.detector_report import CALIBRATION_RUNS, DELTA, INTERVAL, events, lead_share
from mechmon_megatron.research.study.peak_tail import fit_peak_tail, peak_tail_check
from mechmon_megatron.research.study.pooled_replay import (
    CORE_FAMILIES,
    fit_tail_table,
    never_thresholds,
    proxy_shape,
    replay_pooled,
)
from mechmon_megatron.research.study.short_window_study import logit_rule_first, only_families

LOGIT = "attn_logit"
ROUND7_DESIGN = "long+logit5"
ROUND7_TAIL_RUNS = ("healthy-cosine-seed1", "healthy-cosine-seed2", "healthy-cosine-seed3", "healthy-cosine-seed5",
                    "healthy-wsd-seed4")
"""Round 7's logit tail: the two calibration runs of this campaign and the three 10,000-step healthy
runs of the round-2 records (seeds 3, 5 and the WSD seed 4; trained on another CPU)."""
LOO_SIGNIFICANCE = 0.05
"""Family-wise level of the leave-one-out check: the tail model is rejected when, for any of the k
held-out runs, the probability of a maximum at least as large is below ``LOO_SIGNIFICANCE / k``."""


def logit_series(record: CampaignRecord) -> list[tuple[int, float]]:
    """(step, log max attention logit) for every recorded step; NaN where the value is not > 0."""
    out = []
    for step, x in zip(record.data.steps, record.data.max_attn_logit):
        ok = x is not None and math.isfinite(x) and x > 0
        out.append((int(step), math.log(x) if ok else math.nan))
    return out


def replay_logit(series: Sequence[tuple[int, float]], thresholds: FamilyThresholds,
                 start_step: int = 0) -> tuple[Optional[int], list[int], list[float]]:
    """The round-2 study's logit replay (``design_study.logit_replay``) at interval 1: first alarm
    at/after ``start_step``, every alarm step, and the CUSUM after each step past the warm-up."""
    first, alarms, cusums, _ = logit_replay(series, thresholds, logit_config(1, False), start_step)
    return first, [step for step, _ in alarms], cusums


def healthy_logit_cusums(records: Mapping[str, CampaignRecord]) -> dict[str, list[float]]:
    """Per run: the per-step logit CUSUM (CUSUM units, one value per step past the 200-step
    warm-up) replayed with thresholds that never fire, i.e. the null values a tail is fitted on."""
    never = never_thresholds()["attn_delta2"].layer
    return {r: replay_logit(logit_series(rec), FamilyThresholds(never, never))[2] for r, rec in records.items()}


def fit_logit_tail(cusums: Mapping[str, Sequence[float]], runs: Sequence[str]) -> NullTail:
    """The per-step null tail fitted on the pooled CUSUM values of exactly ``runs`` (in that
    order; KeyError for a run not in ``cusums``, ValueError for a repeated or empty list)."""
    if not runs or len(set(runs)) != len(runs):
        raise ValueError(f"need distinct runs to fit the logit tail, got {list(runs)}")
    values: list[float] = []
    for r in runs:
        values += list(cusums[r])
    return fit_null_tail(values)


def resolve_tail_records(names: Sequence[str], records: Mapping[str, CampaignRecord],
                         other: Mapping[str, CampaignRecord]) -> dict[str, CampaignRecord]:
    """The records of exactly ``names``, in that order: from ``records`` (this campaign) when there,
    else from ``other`` (the round-2 records). KeyError names the missing ones, ValueError a
    fault run."""
    missing = [n for n in names if n not in records and n not in other]
    if missing:
        raise KeyError(f"no record for {missing}")
    out = {n: records[n] if n in records else other[n] for n in names}
    faults = [n for n, r in out.items() if not r.healthy]
    if faults:
        raise ValueError(f"only healthy runs fit the logit tail, not {faults}")
    return out


@dataclass(frozen=True, slots=True)
class LeaveOneOut:
    """One held-out run of the leave-one-out check of the per-step logit tail."""

    held_out: str
    fitted_on: tuple[str, ...]
    steps: int
    """CUSUM values of the held-out run (steps past the warm-up)."""
    max_cusum: float
    """Largest CUSUM of the held-out run (CUSUM units)."""
    alarm_level: float
    """Alarm level the other runs give at the per-step probability (CUSUM units)."""
    alarm: bool
    """``max_cusum > alarm_level``: the held-out run would raise a false alarm."""
    log10_p_step: float
    """log10 of the fitted P0(S > max_cusum) per step, with the tail's theta (the lower
    confidence bound the levels use: the heavier, cautious tail)."""
    log10_p_step_ml: float
    """The same with the maximum-likelihood theta."""
    p_max: float
    """``1 - (1 - p)^steps`` with p = 10^log10_p_step: the probability under the fitted tail that
    the largest of ``steps`` independent values reaches ``max_cusum``. Autocorrelation (the CUSUM's
    excursions last many steps) can only lower it: for a stationary sequence P(max > h) is about
    ``1 - F(h)^(steps * e)`` with extremal index ``e <= 1``, so this is (to that approximation) an
    upper bound, and a small value rejects the tail."""
    p_max_ml: float
    """The same with the maximum-likelihood theta."""
    tail: dict[str, Any]
    """The tail fitted on ``fitted_on`` (``NullTail.to_dict``)."""


def _p_max(log_p: float, steps: int) -> float:
    p = math.exp(log_p)
    return -math.expm1(steps * math.log1p(-p)) if p < 1 else 1.0


def leave_one_out(cusums: Mapping[str, Sequence[float]], runs: Sequence[str],
                  p_step: float) -> list[LeaveOneOut]:
    """For each of ``runs``: fit the tail on the others (:func:`fit_logit_tail`), its alarm level at
    ``p_step`` (per-step probability), and how the held-out run's largest CUSUM compares."""
    out = []
    for held in runs:
        others = tuple(r for r in runs if r != held)
        tail = fit_logit_tail(cusums, others)
        values = [float(v) for v in cusums[held] if math.isfinite(v)]
        top = max(values)
        level = tail.threshold(p_step)
        log_p = min(0.0, tail.log_survival(top))
        log_p_ml = min(0.0, tail.log_p_u0 - tail.theta_hat * max(0.0, top - tail.u0))
        out.append(LeaveOneOut(
            held_out=held, fitted_on=others, steps=len(values), max_cusum=top, alarm_level=level,
            alarm=top > level, log10_p_step=log_p / math.log(10), log10_p_step_ml=log_p_ml / math.log(10),
            p_max=_p_max(log_p, len(values)), p_max_ml=_p_max(log_p_ml, len(values)), tail=tail.to_dict()))
    return out


def loo_rejects(checks: Sequence[LeaveOneOut], significance: float = LOO_SIGNIFICANCE) -> bool:
    """The tail model is rejected when some held-out maximum has ``p_max < significance / k``."""
    return any(c.p_max < significance / len(checks) for c in checks)


def run_logit_step_study(records: Mapping[str, CampaignRecord], rule_threshold: Optional[float],
                         rate: float = DEFAULT_FALSE_ALARM_RATE,
                         calibration: Sequence[str] = CALIBRATION_RUNS,
                         extra_healthy: Mapping[str, CampaignRecord] = (),
                         logit_tail_records: Optional[Mapping[str, CampaignRecord]] = None,
                         design: str = "long+logit") -> dict[str, Any]:
    """Per run: first alarms of ``long`` and ``long+logit``, the rule, leads; healthy alarms.
    ``extra_healthy``: healthy runs judged by the logit test only (other records).
    ``logit_tail_records``: the healthy runs whose per-step CUSUM fits the logit tail (default:
    the ``calibration`` runs of ``records``; round 7: all five 10,000-step healthy runs); when
    given, the result also holds the leave-one-out check over them. ``design`` names the design
    in the output (the JSON keys stay ``long+logit``)."""
    overlap = max(1, math.ceil(DELTA / INTERVAL))
    series = [only_families(records[r].data.checks, CORE_FAMILIES) for r in calibration]
    table, _ = fit_tail_table({overlap: (INTERVAL, series)}, source="calibration runs")
    tail_records = dict(logit_tail_records) if logit_tail_records is not None else {r: records[r] for r in calibration}
    tail_cusums = healthy_logit_cusums(tail_records)
    tail = fit_logit_tail(tail_cusums, list(tail_records))
    cusums = [v for r in tail_records for v in tail_cusums[r]]
    shape = proxy_shape(series[0], INTERVAL, overlap)
    long_thr, long_acc = thresholds_for_job(shape, rate, table)
    # N + 1 tests: each check test's R / (N C) becomes R / ((N + 1) C), i.e. the N check tests
    # share R N / (N + 1); the step test gets R / ((N + 1) 10^6).
    n = shape.num_tests()
    with_thr, with_acc = thresholds_for_job(shape, rate * n / (n + 1), table)
    p_step = rate / ((n + 1) * 1e6)
    warning = tail.threshold(min(0.5, 1000 * p_step))
    t = Thresholds(warning=max(warning, 1e-6), alarm=max(tail.threshold(p_step), warning, 1e-6))
    logit_thr = FamilyThresholds(t, t)
    config = default_sequential_config(INTERVAL)
    out: dict[str, Any] = {
        "rate_per_million": rate, "calibration_runs": list(calibration), "tests_long": n, "tests_with_logit": n + 1,
        "logit_tail": tail.to_dict(), "logit_levels": {"warning": t.warning, "alarm": t.alarm},
        "logit_step_probability": p_step, "long_check_probability": long_acc["per_test_check_probability"],
        "with_logit_check_probability": with_acc["per_test_check_probability"],
        "max_logit_rule_threshold": rule_threshold, "max_healthy_logit_cusum": max(cusums), "runs": {},
        "design_name": design, "logit_tail_runs": list(tail_records),
        "logit_tail_max_cusum": {r: max(v) for r, v in tail_cusums.items()},
    }
    peak_thr = None
    if logit_tail_records is not None and len(tail_records) > 2:
        checks = leave_one_out(tail_cusums, list(tail_records), p_step)
        out["leave_one_out"] = [asdict(c) for c in checks]
        out["leave_one_out_rejects_tail"] = loo_rejects(checks)
        out["peak_tail"], peak_thr = _peak_tail_section(tail_cusums, records, tail_records, p_step)
    for run_id, record in sorted(records.items()):
        onset = record.run.fault_onset or 0
        checks = only_families(record.data.checks, CORE_FAMILIES)
        entry: dict[str, Any] = {
            "healthy": record.healthy, "seed": record.run.seed, "scenario": record.run.scenario,
            "onset": record.run.fault_onset, "calibration": run_id in calibration,
            "logit_tail": tail_records.get(run_id) is record, **events(record),
            "max_logit_rule": None if record.healthy else logit_rule_first(record, rule_threshold),
            "last_step": record.data.steps[-1] if record.data.steps else None,
        }
        for design, thr in (("long", long_thr), ("long+logit", with_thr)):
            replay = replay_pooled(checks, thr, config, start_step=onset)
            first, family = earliest_alarm(replay.first_alarm, CORE_FAMILIES)
            attn, _ = earliest_alarm(replay.first_alarm, ("attn_delta2", "attn_dw"))
            entry[design] = {"first_alarm": first, "first_family": family, "attention": attn,
                             "alarms": len(replay.alarms), "by_family": dict(replay.first_alarm)}
        logit_first, logit_alarms, _ = replay_logit(logit_series(record), logit_thr, onset)
        entry["logit"] = {"first_alarm": logit_first, "alarms": len(logit_alarms)}
        if peak_thr is not None and not record.healthy:
            entry["logit_peak_lightest"] = replay_logit(logit_series(record), peak_thr, onset)[0]
        both = entry["long+logit"]
        if logit_first is not None and (both["first_alarm"] is None or logit_first < both["first_alarm"]):
            both["first_alarm"], both["first_family"] = logit_first, LOGIT
        both["alarms"] += len(logit_alarms)
        entry["attention_lead_share"] = lead_share(entry["long+logit"]["attention"], entry["divergence"], onset)
        entry["first_lead_share"] = lead_share(both["first_alarm"], entry["divergence"], onset)
        entry["rule_lead_share"] = lead_share(entry["max_logit_rule"], entry["divergence"], onset)
        out["runs"][run_id] = entry
    for run_id, record in sorted(dict(extra_healthy).items()):
        _, logit_alarms, _ = replay_logit(logit_series(record), logit_thr, 0)
        out["runs"][f"{run_id} (round 2)"] = {"healthy": True, "extra": True, "last_step": record.data.steps[-1],
                                             "logit_tail": tail_records.get(run_id) is record,
                                             "logit": {"first_alarm": None, "alarms": len(logit_alarms)}}
    return out


def _peak_tail_section(tail_cusums: Mapping[str, Sequence[float]], records: Mapping[str, CampaignRecord],
                       tail_records: Mapping[str, CampaignRecord],
                       p_step: float) -> tuple[dict[str, Any], FamilyThresholds]:
    """The round-7 addendum (``peak_tail``): the GPD tail of the per-step CUSUM's cluster peaks on
    the tail runs, its leave-one-out check, the out-of-sample check of every other healthy run of
    ``records`` (the held-out seeds 10-12 once they exist), and the thresholds of the lightest
    plausible tail (the most sensitive level any tail that fits could justify)."""
    names = list(tail_records)
    tail = fit_peak_tail(tail_cusums, names)
    others = {r: rec for r, rec in sorted(records.items()) if rec.healthy and r not in tail_records}
    cusums = {**tail_cusums, **healthy_logit_cusums(others)}
    lightest = tail.lightest()
    warning = lightest.level(min(0.5, 1000 * p_step))
    t = Thresholds(warning=warning, alarm=max(lightest.level(p_step), warning))
    section = {"fit": asdict(tail), "alarm_level": tail.level(p_step), "alarm_level_lightest": t.alarm,
               "leave_one_out": [asdict(c) for c in peak_tail_check(cusums, names, names, p_step)],
               "out_of_sample": [asdict(c) for c in peak_tail_check(cusums, names, list(others), p_step)]}
    return section, FamilyThresholds(t, t)


def _no_later(first: Optional[int], rule: Optional[int]) -> bool:
    return first is not None and (rule is None or first <= rule)


def group_of(run_id: str) -> str:
    """choice (seeds 1-3), held-out 4-6, held-out 7-9, held-out 10-12 (round 7), or lr."""
    if run_id.startswith("moe-"):
        return "lr"
    seed = int(run_id.rsplit("seed", 1)[1].split()[0])
    if seed <= 3:
        return "choice"
    return "held-out 4-6" if seed <= 6 else "held-out 7-9" if seed <= 9 else "held-out 10-12"


def _peak_tail_markdown(results: Mapping[str, Any]) -> list[str]:
    pt = results["peak_tail"]
    fit = pt["fit"]
    lines = [f"Peak tail (GPD of cluster peaks above {fit['u']:g}; {fit['peaks_above']} peaks in {fit['steps']} "
             f"steps): xi {fit['xi']:.2f} (95 % lower end {fit['xi_low']:.2f}), sigma {fit['sigma']:.2f}; alarm "
             f"level {pt['alarm_level']:.0f} (lightest plausible tail: {pt['alarm_level_lightest']:.0f}).", "",
             "| held out | how | steps | largest CUSUM | alarm level of the fit (lightest) | p(max) | xi |",
             "|---|---|---|---|---|---|---|"]
    for how, rows in (("leave one out", pt["leave_one_out"]), ("not in the fit", pt["out_of_sample"])):
        for c in rows:
            lines.append(f"| {c['held_out']} | {how} | {c['steps']} | {c['max_cusum']:.2f} | {c['alarm_level']:.0f} "
                         f"({c['alarm_level_lightest']:.0f}) | {c['p_max']:.2g} | {c['xi']:.2f} |")
    counts: dict[str, list[int]] = {}
    for run_id, e in results["runs"].items():
        if e["healthy"] or e.get("scenario") != "fa" or "logit_peak_lightest" not in e:
            continue
        c = counts.setdefault(group_of(run_id), [0, 0, 0])
        c[0] += 1
        c[1] += e["logit_peak_lightest"] is not None
        c[2] += _no_later(e["logit_peak_lightest"], e["max_logit_rule"])
    lines += ["", "The logit test at the lightest plausible peak tail's level (FA runs; fired / no later than the "
              "max-logit rule): " + "; ".join(f"{g}: {c[1]} / {c[2]} of {c[0]}" for g, c in sorted(counts.items())),
              ""]
    return lines


def markdown(results: Mapping[str, Any]) -> str:
    """The fault table, the learning-rate table, the healthy table, and per-group counts."""
    def d(x: Optional[int], onset: int) -> str:
        return "-" if x is None else f"+{x - onset}"

    def pct(x: Optional[float]) -> str:
        return "-" if x is None else f"{100 * x:.0f} %"

    runs = results["runs"]
    name = results.get("design_name", "long+logit")
    tail_runs = results.get("logit_tail_runs", results["calibration_runs"])
    lines = [f"R = {results['rate_per_million']} per 10^6 steps; tests {results['tests_long']} (long) / "
             f"{results['tests_with_logit']} ({name}); logit alarm level {results['logit_levels']['alarm']:.2f} "
             f"(tail fitted on {', '.join(tail_runs)}; largest healthy CUSUM on them "
             f"{results['max_healthy_logit_cusum']:.2f}); max-logit rule threshold "
             f"{results['max_logit_rule_threshold']}.", ""]
    if "leave_one_out" in results:
        lines += ["Leave-one-out check of the logit tail (fit on the others; p per step and p of the maximum "
                  "with the levels' theta / the maximum-likelihood theta):", "",
                  "| held out | steps | largest CUSUM | alarm level of the others | alarm | log10 p per step | "
                  "p(max) | p(max), ML theta |", "|---|---|---|---|---|---|---|---|"]
        for c in results["leave_one_out"]:
            lines.append(f"| {c['held_out']} | {c['steps']} | {c['max_cusum']:.2f} | {c['alarm_level']:.2f} | "
                         f"{'yes' if c['alarm'] else 'no'} | {c['log10_p_step']:.1f} / {c['log10_p_step_ml']:.1f} | "
                         f"{c['p_max']:.2g} | {c['p_max_ml']:.2g} |")
        k = len(results["leave_one_out"])
        lines += ["", f"Tail model {'REJECTED' if results['leave_one_out_rejects_tail'] else 'not rejected'} "
                  f"(rule: some p(max) < {LOO_SIGNIFICANCE} / {k}).", ""]
    if "peak_tail" in results:
        lines += _peak_tail_markdown(results)
    lines += ["| run | group | div. | long (today) | " + name + " | Δ2 / dW (" + name + ") | logit test | "
              "max-logit rule | long <= rule | " + name + " <= rule | lead Δ2/dW | lead first | lead rule |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    counts: dict[str, list[int]] = {}
    for run_id, e in sorted(runs.items(), key=lambda kv: (group_of(kv[0]), kv[0])):
        if e["healthy"] or e.get("scenario") != "fa":
            continue
        onset = e["onset"] or 0
        g = group_of(run_id)
        rule = e["max_logit_rule"]
        a, b = _no_later(e["long"]["first_alarm"], rule), _no_later(e["long+logit"]["first_alarm"], rule)
        c = counts.setdefault(g, [0, 0, 0])
        c[0] += 1
        c[1] += a
        c[2] += b
        lines.append(
            f"| {run_id} | {g} | {d(e['divergence'], onset)} | {d(e['long']['first_alarm'], onset)} "
            f"{e['long']['first_family'] or ''} | {d(e['long+logit']['first_alarm'], onset)} "
            f"{e['long+logit']['first_family'] or ''} | {d(e['long+logit']['attention'], onset)} | "
            f"{d(e['logit']['first_alarm'], onset)} | {d(rule, onset)} | {'yes' if a else 'no'} | "
            f"{'yes' if b else 'no'} | {pct(e['attention_lead_share'])} | {pct(e['first_lead_share'])} | "
            f"{pct(e['rule_lead_share'])} |")
    lines += ["", "First alarm no later than the max-logit rule (FA runs): "
              + "; ".join(f"{g}: long {c[1]} of {c[0]}, {name} {c[2]} of {c[0]}"
                          for g, c in sorted(counts.items())),
              "", "Learning-rate faults (from step 1; steps):", "",
              f"| run | long first | {name} first | attention alarms (Δ2/dW) | logit test | max-logit rule |",
              "|---|---|---|---|---|---|"]
    for run_id, e in sorted(runs.items()):
        if e["healthy"] or e.get("scenario") == "fa":
            continue
        bf = e["long+logit"]["by_family"]
        attn = [f"{f} {bf[f]}" for f in ("attn_delta2", "attn_dw") if bf.get(f) is not None]
        lines.append(f"| {run_id} | {e['long']['first_alarm']} {e['long']['first_family'] or ''} | "
                     f"{e['long+logit']['first_alarm']} {e['long+logit']['first_family'] or ''} | "
                     f"{', '.join(attn) or 'none'} | {e['logit']['first_alarm'] or '-'} | "
                     f"{e['max_logit_rule'] or '-'} |")
    lines += ["", "Healthy runs (all alarms, any step; * = calibration run, † = fits the logit tail):", "",
              f"| run | steps | long | {name} |", "|---|---|---|---|"]
    for run_id, e in sorted(runs.items()):
        if not e["healthy"]:
            continue
        star = (" *" if e.get("calibration") else "") + (" †" if e.get("logit_tail") else "")
        long_alarms = "-" if e.get("extra") else str(e["long"]["alarms"])
        both = e["logit"]["alarms"] if e.get("extra") else e["long+logit"]["alarms"]
        lines.append(f"| {run_id}{star} | {e['last_step']} | {long_alarms} | {both} |")
    return "\n".join(lines) + "\n"
