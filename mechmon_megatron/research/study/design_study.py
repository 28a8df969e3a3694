"""Design study (offline, on the committed records): CUSUM alone vs CUSUM + Shewhart.

Everything is measured at the SAME false-alarm rate (the session default R = 0.01 per 10^6
steps, union bound over the job's tests, docs/METHOD.md section 7 step 4), at interval 20
(delta 100, as recorded) and interval 100 (every 5th check, ``pooled_replay.subsample``):

- ``cusum``: today's detector (the shipped design);
- ``cusum+shewhart``: the same CUSUMs, plus each test's Shewhart limit on the per-check pooled
  residual; each test's probability is split evenly between the two (``SHEWHART_SHARE``);
- ``attn_logit`` (RESEARCH ONLY, not in the product): the log of the recorded max attention
  logit at check steps, as one more one-layer family with a robust-trend residual (fault
  direction: rise), its own CUSUM (and Shewhart limit), calibrated on the same healthy runs.
  It is reported as its own family ("attention logit growth"), never as the precision
  mechanism. Its test is counted in the union bound (``N + 1`` tests, or ``2 (N + 1)`` with
  Shewhart limits); the product families keep the thresholds of their own ``N`` tests (the
  difference is ``log((N+1)/N) / theta``, under 0.1 units).
- the max-attention-logit growth rule at its most sensitive threshold quiet on every healthy
  run (``detector_report.symptom_sweeps`` / ``operating_index``).

Calibration: the null tails are fitted on ``detector_report.CALIBRATION_RUNS`` only (the
shipped calibration); every other healthy run is held out and its alarms are counted. The
design is chosen on these records (fault seeds 1-3): it is pre-registered to be reported
unchanged on fault seeds 4-6 (docs/RESULTS.md). Needs numpy (the symptom-rule scores).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from mechmon_megatron.detect.null_model import (
    DEFAULT_FALSE_ALARM_RATE,
    SHEWHART_SHARE,
    NullTail,
    fit_null_tail,
)
from mechmon_megatron.detect.pooled_cusum import (
    FamilyThresholds,
    Observation,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
    default_sequential_config,
)
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.detector_report import (
    CALIBRATION_RUNS,
    DELTA,
    INTERVAL,
    calibrate,
    events,
    lead_share,
    operating_index,
    symptom_sweeps,
)
from mechmon_megatron.research.study.pooled_replay import (
    CORE_FAMILIES as FAMILIES,
)
from mechmon_megatron.research.study.pooled_replay import (
    calibrate_on_runs,
    never_thresholds,
    proxy_shape,
    replay_pooled,
    subsample,
    thresholds_at_rate,
)
from mechmon_megatron.session.detector_inputs import observations_from_scalars

DESIGNS: tuple[str, ...] = ("cusum", "cusum+shewhart")
EVERY: tuple[int, ...] = (1, DELTA // INTERVAL)
"""Interval 20 (as recorded) and interval 100 (every 5th check)."""
ATTN = ("attn_delta2", "attn_dw")
LOGIT_CARRIER = "router_weights"
"""The logit stream is run through the product's detector code in the slot of a family whose
fault direction is a rise (a research shortcut: the product has no logit family)."""


# ------------------------------------------------------------------------------ logit family
def logit_checks(record: CampaignRecord, every: int) -> list[tuple[int, float]]:
    """(check step, log max attention logit at that step) for the run's (subsampled) checks."""
    by_step = dict(zip(record.data.steps, record.data.max_attn_logit))
    out = []
    for step, _ in subsample(record.data.checks, INTERVAL, every):
        x = by_step.get(step, math.nan)
        out.append((step, math.log(x) if x is not None and math.isfinite(x) and x > 0 else math.nan))
    return out


def logit_config(interval: int, shewhart: bool) -> SequentialConfig:
    base = default_sequential_config(interval)
    return dataclasses.replace(base, family_trends={}, shewhart=shewhart)


def logit_replay(series: Sequence[tuple[int, float]], thresholds: FamilyThresholds, config: SequentialConfig,
                  start_step: int) -> tuple[Optional[int], list[tuple[int, str]], list[float], list[float]]:
    """First alarm at/after ``start_step``, all alarms (step, kind), CUSUM and residual values."""
    det = PooledCusumDetector({LOGIT_CARRIER: thresholds}, config)
    first, alarms, cusums, residuals = None, [], [], []
    for step, value in series:
        r = det.update(step, [Observation(LOGIT_CARRIER, 1, "", value)])
        if f"{LOGIT_CARRIER}/cusum/layer_1" in r.statistics:
            cusums.append(r.statistics[f"{LOGIT_CARRIER}/cusum/layer_1"])
            residuals.append(r.statistics[f"{LOGIT_CARRIER}/residual/layer_1"])
        for a in r.alarms:
            alarms.append((step, a.kind))
            if first is None and step >= start_step:
                first = step
    return first, alarms, cusums, residuals


def logit_tails(records: Mapping[str, CampaignRecord], every: int) -> tuple[NullTail, NullTail]:
    """CUSUM and residual null tails of the logit family on the calibration runs."""
    never = never_thresholds()["attn_delta2"].layer
    cusums: list[float] = []
    residuals: list[float] = []
    for run_id in CALIBRATION_RUNS:
        _, _, c, r = logit_replay(
            logit_checks(records[run_id], every), FamilyThresholds(never, never),
            logit_config(INTERVAL * every, False), 0,
        )
        cusums += c
        residuals += r
    return fit_null_tail(cusums), fit_null_tail(residuals)


# ------------------------------------------------------------------------------ the study
def _tests(records: Mapping[str, CampaignRecord], every: int) -> int:
    sample = next(iter(records.values())).data.checks
    return proxy_shape(sample, INTERVAL * every, 1).num_tests()


def _logit_thresholds(tails: tuple[NullTail, NullTail], tests: int, every: int, shewhart: bool,
                      rate: float) -> FamilyThresholds:
    p = rate / ((tests + 1) * 1e6 / (INTERVAL * every))
    p_cusum = p * (1 - SHEWHART_SHARE) if shewhart else p
    cusum_tail, residual_tail = tails
    warning = cusum_tail.threshold(min(0.5, 1000 * p_cusum))
    alarm = max(cusum_tail.threshold(p_cusum), warning)
    limit = residual_tail.threshold(p * SHEWHART_SHARE) if shewhart else None
    t = Thresholds(warning=max(warning, 1e-6), alarm=max(alarm, 1e-6), shewhart=limit)
    return FamilyThresholds(layer=t, family=t)


def earliest_alarm(firsts: Mapping[str, Optional[int]], families: Sequence[str]) -> tuple[Optional[int], Optional[str]]:
    best: tuple[Optional[int], Optional[str]] = (None, None)
    for f in families:
        s = firsts.get(f)
        if s is not None and (best[0] is None or s < best[0]):
            best = (s, f)
    return best


def run_study(records: Mapping[str, CampaignRecord], rate: float = DEFAULT_FALSE_ALARM_RATE) -> dict[str, Any]:
    """Per run and interval: first alarms of each design, family and rule; healthy alarms."""
    table_plain, _ = calibrate(records)
    table, fit_log = calibrate_on_runs(
        [records[r].data.checks for r in CALIBRATION_RUNS], INTERVAL, DELTA, shewhart=True
    )
    assert table.to_dict()["tails"] == table_plain.to_dict()["tails"]  # the CUSUM tails are today's
    healthy_steps = sum(r.data.steps[-1] for r in records.values() if r.healthy and r.data.steps)
    sweeps = symptom_sweeps(records)
    logit_rule = sweeps["max_attn_logit"]
    idx = operating_index(logit_rule, healthy_steps, None)
    rule_first = logit_rule.first_alarm[idx] if idx is not None else {}
    out: dict[str, Any] = {
        "rate_per_million": rate,
        "calibration_runs": list(CALIBRATION_RUNS),
        "shewhart_share": SHEWHART_SHARE,
        "max_logit_rule_threshold": logit_rule.thresholds[idx] if idx is not None else None,
        "healthy_steps": healthy_steps,
        "shewhart_fit": {k: v for k, v in fit_log.items() if k.startswith("shewhart/")},
        "intervals": {},
    }
    for every in EVERY:
        interval = INTERVAL * every
        overlap = max(1, math.ceil(DELTA / interval))
        sample = next(iter(records.values())).data.checks
        tests = _tests(records, every)
        ltails = logit_tails(records, every)
        block: dict[str, Any] = {"interval": interval, "overlap": overlap, "tests": tests, "thresholds": {},
                                 "logit_tails": {"cusum": ltails[0].to_dict(), "residual": ltails[1].to_dict()},
                                 "runs": {}}
        for design in DESIGNS:
            shewhart = design == "cusum+shewhart"
            thresholds, account = thresholds_at_rate(sample, interval, overlap, rate, table, shewhart=shewhart)
            block["thresholds"][design] = account.to_dict()["thresholds"]
            lth = _logit_thresholds(ltails, tests, every, shewhart, rate)
            block["thresholds"][f"attn_logit/{design}"] = dataclasses.asdict(lth.layer)
            config = dataclasses.replace(default_sequential_config(interval), shewhart=shewhart)
            for run_id, record in records.items():
                onset = record.run.fault_onset or 0
                checks = subsample(record.data.checks, INTERVAL, every)
                replay = replay_pooled(checks, thresholds, config, start_step=onset)
                lfirst, lalarms, _, _ = logit_replay(logit_checks(record, every), lth,
                                                      logit_config(interval, shewhart), onset)
                entry = block["runs"].setdefault(run_id, {
                    "healthy": record.healthy,
                    "scenario": record.run.scenario,
                    "seed": record.run.seed,
                    "fa_strength": record.run.fa_strength,
                    "onset": record.run.fault_onset,
                    "calibration": run_id in CALIBRATION_RUNS,
                    **events(record),
                    "max_logit_rule": rule_first.get(run_id),
                })
                first, family = earliest_alarm(replay.first_alarm, FAMILIES)
                attn, _ = earliest_alarm(replay.first_alarm, ATTN)
                kinds = {(a.step, a.family): a.kind for a in replay.alarms}
                entry[design] = {
                    "first_alarm": first,
                    "first_family": family,
                    "first_kind": kinds.get((first, family)) if first is not None else None,
                    "by_family": dict(replay.first_alarm),
                    "attention": attn,
                    "attention_lead_share": lead_share(attn, entry["divergence"], onset),
                    "alarms": [[a.step, a.family, a.level, a.kind] for a in replay.alarms],
                    "attn_logit": lfirst,
                    "attn_logit_alarms": lalarms,
                }
            if not shewhart:
                block["misfit"] = misfit_on_healthy(records, every, thresholds, config,
                                                    account.warning_per_test_check_probability)
            for entry in block["runs"].values():
                entry["max_logit_rule_lead_share"] = lead_share(entry["max_logit_rule"], entry["divergence"],
                                                                entry["onset"] or 0)
        out["intervals"][str(interval)] = block
    return out


def misfit_on_healthy(records: Mapping[str, CampaignRecord], every: int, thresholds: Mapping[str, FamilyThresholds],
                      config: SequentialConfig, warning_probability: float) -> dict[str, Any]:
    """The product's calibration misfit counter replayed on every healthy run: per family the
    warning episodes before its first alarm, the tail model's expectation, and whether it fired."""
    out: dict[str, Any] = {}
    for run_id, record in records.items():
        if not record.healthy:
            continue
        det = PooledCusumDetector(thresholds, config, warning_probability=warning_probability)
        fired: dict[str, int] = {}
        for step, scalars in subsample(record.data.checks, INTERVAL, every):
            r = det.update(step, observations_from_scalars(scalars))
            for f in r.misfits:
                fired[f] = step
        assert det.misfit is not None
        out[run_id] = {
            f: {"observed": det.misfit.statistics(f)[f"{f}/calibration_misfit/observed"],
                "expected": det.misfit.expected(f), "fired_at": fired.get(f)}
            for f in FAMILIES
        }
    return out


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{100 * x:.0f} %"
    return str(x)


def markdown(results: Mapping[str, Any]) -> str:
    """The tables of docs/RESULTS.md ("Designs evaluated and not adopted")."""
    lines = [
        f"R = {results['rate_per_million']:g} per 10^6 steps; "
        f"calibration runs {', '.join(results['calibration_runs'])}; "
        f"Shewhart share {results['shewhart_share']:g}; max-logit rule threshold (quiet on every healthy run) "
        f"{results['max_logit_rule_threshold']}.",
        "",
    ]
    for interval, block in results["intervals"].items():
        lines += [
            f"**Interval {interval}** (overlap {block['overlap']}, {block['tests']} tests). First alarm at/after the "
            "onset, steps after the onset (kind: c = CUSUM, s = Shewhart); lead = share of onset-to-divergence "
            "left by the attention alarm.",
            "",
            "| run | div. | today (CUSUM) | CUSUM+Shewhart | Δ2 (C+S) | dW (C+S) | attn logit CUSUM (research) "
            "| attn logit C+S (research) | max-logit rule | lead today | lead C+S | lead rule |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for run_id, e in block["runs"].items():
            if e["healthy"]:
                continue
            onset = e["onset"] or 0

            def rel(s: Optional[int], onset: int = onset) -> str:
                return "-" if s is None else f"+{s - onset}"

            def first(d: Mapping[str, Any], rel=rel) -> str:
                if d["first_alarm"] is None:
                    return "-"
                return f"{rel(d['first_alarm'])} {d['first_family']} ({(d['first_kind'] or '?')[0]})"

            c, s = e["cusum"], e["cusum+shewhart"]
            lines.append(
                f"| {run_id} | {rel(e['divergence'])} | {first(c)} | {first(s)} | {rel(s['by_family']['attn_delta2'])} "
                f"| {rel(s['by_family']['attn_dw'])} | {rel(c['attn_logit'])} | {rel(s['attn_logit'])} "
                f"| {rel(e['max_logit_rule'])} | {_fmt(c['attention_lead_share'])} "
                f"| {_fmt(s['attention_lead_share'])} | {_fmt(e['max_logit_rule_lead_share'])} |"
            )
        lines += ["", "Healthy runs (all alarms, any step; * = calibration run):", "",
                  "| run | today (CUSUM) | CUSUM+Shewhart | attn logit CUSUM | attn logit C+S |",
                  "|---|---|---|---|---|"]
        for run_id, e in block["runs"].items():
            if not e["healthy"]:
                continue

            def alarms(d: Mapping[str, Any]) -> str:
                return str(len(d["alarms"])) + (
                    " (" + ", ".join(f"{a[0]} {a[1]} {a[3]}" for a in d["alarms"][:3]) + ")" if d["alarms"] else ""
                )

            c, s = e["cusum"], e["cusum+shewhart"]
            lines.append(
                f"| {run_id}{' *' if e['calibration'] else ''} | {alarms(c)} | {alarms(s)} "
                f"| {len(c['attn_logit_alarms'])} | {len(s['attn_logit_alarms'])} |"
            )
        lines += ["", "Calibration misfit counter (today's design) on the healthy runs: warning episodes observed / "
                  "expected by the tail model (step where it fired):", "",
                  "| run | " + " | ".join(FAMILIES) + " |", "|---|" + "---|" * len(FAMILIES)]
        for run_id, fams in block["misfit"].items():
            cells = [
                f"{int(v['observed'])} / {v['expected']:.3g}" + (f" (fired {v['fired_at']})" if v["fired_at"] else "")
                for v in (fams[f] for f in FAMILIES)
            ]
            lines.append(f"| {run_id} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
