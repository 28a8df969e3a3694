"""Issue 19: the long window's CUSUM alone vs long + short windows (``--mechmon-short-window``),
at the SAME false-alarm rate, on the records of the short-window campaign
(:mod:`~mechmon_megatron.research.study.short_window_plan`).

- ``long``: today's detector (the four product families; the recorded short-window streams are
  dropped before the replay), ``N`` tests in the union bound;
- ``long+short``: the same, plus the ``attn_delta2_short`` family (Delta2 over the last
  ``interval`` steps), one CUSUM per layer and its family CUSUM: ``N + L + 1`` tests, so every
  test's probability is ``R / ((N + L + 1) C)`` (the split of the union bound: the long tests'
  thresholds rise by ``log((N + L + 1) / N) / theta``).

Null tails are fitted on the calibration runs only (``detector_report.CALIBRATION_RUNS``), for
every family at the study's overlap (interval 20, delta 100). Only interval 20: at interval 100
the short window is the long one. The max attention logit rule is the study's
(``rule_scores``) at a fixed threshold (its most sensitive quiet on every healthy run of the
committed detector study, :func:`logit_rule_threshold`). Needs numpy (the rule scores).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, TailTable, load_tail_table
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.study import rule_scores
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.design_study import earliest_alarm
from mechmon_megatron.research.study.detector_report import (
    CALIBRATION_RUNS,
    DELTA,
    INTERVAL,
    events,
    lead_share,
    operating_index,
    symptom_sweeps,
)
from mechmon_megatron.research.study.pooled_replay import (
    CORE_FAMILIES,
    Checks,
    fit_tail_table,
    replay_pooled,
    thresholds_at_rate,
)
from mechmon_megatron.session.detector_inputs import stream_family

SHORT = "attn_delta2_short"
LONG_FAMILIES = CORE_FAMILIES
ATTN_LONG = ("attn_delta2", "attn_dw")
DESIGNS: dict[str, tuple[str, ...]] = {
    "long": LONG_FAMILIES,
    "long+short": (*LONG_FAMILIES, SHORT),
}
LOGIT_RULE = "max_attn_logit"


def only_families(checks: Checks, families: Sequence[str]) -> list[tuple[int, dict[str, float]]]:
    """The checks with every detector stream outside ``families`` removed (other scalars kept)."""
    keep = set(families)
    out = []
    for step, scalars in checks:
        out.append((step, {k: v for k, v in scalars.items() if (f := stream_family(k)) is None or f in keep}))
    return out


def calibrate_short(records: Mapping[str, CampaignRecord],
                    calibration: Sequence[str] = CALIBRATION_RUNS) -> tuple[TailTable, dict[str, Any]]:
    """Null tails of every recorded family (the short one included) on the calibration runs, at
    the study's overlap; ``ValueError`` naming the runs that are missing or lack the short family."""
    missing = [r for r in calibration if r not in records]
    if missing:
        raise ValueError(f"calibration runs {missing} are not in the records")
    unfinished = {r: (records[r].status.get("state"), records[r].data.steps[-1] if records[r].data.steps else 0)
                  for r in calibration if records[r].status.get("state") != "done"}
    if unfinished:
        raise ValueError("calibration runs not finished (state, last step): "
                         + ", ".join(f"{r} {s} {n}" for r, (s, n) in unfinished.items())
                         + "; the design is calibrated on complete runs only (resume the campaign)")
    series = [records[r].data.checks for r in calibration]
    lacking = [r for r, c in zip(calibration, series) if not any(stream_family(k) == SHORT for _, sc in c for k in sc)]
    if lacking:
        raise ValueError(f"calibration runs {lacking} have no {SHORT} streams (recorded without "
                         "--mechmon-short-window)")
    overlap = max(1, math.ceil(DELTA / INTERVAL))
    source = f"short-window calibration runs {', '.join(calibration)}"
    # The product families exactly as the shipped table is fitted (their fallback pools never see
    # the short streams); the short family from all streams (its fallback pool: every family).
    table, log = fit_tail_table({overlap: (INTERVAL, [only_families(c, CORE_FAMILIES) for c in series])},
                                source=source)
    full, full_log = fit_tail_table({overlap: (INTERVAL, series)}, source=source)
    table.tails[overlap][SHORT] = full.tails[overlap][SHORT]
    log.update({k: v for k, v in full_log.items() if f"/{SHORT}/" in k})
    return table, log


def logit_rule_threshold(records: Mapping[str, CampaignRecord]) -> Optional[float]:
    """The max-logit rule's most sensitive threshold with no alarm on any healthy run of ``records``."""
    healthy_steps = sum(r.data.steps[-1] for r in records.values() if r.healthy and r.data.steps)
    sweep = symptom_sweeps(records)[LOGIT_RULE]
    idx = operating_index(sweep, healthy_steps, None)
    return None if idx is None else float(sweep.thresholds[idx])


def logit_rule_first(record: CampaignRecord, threshold: Optional[float]) -> Optional[int]:
    """First alarm episode of the max-logit rule that starts at or after the onset."""
    if threshold is None:
        return None
    d = record.data
    series = rule_scores.rule_scores(d.steps, d.loss, d.grad_norm, d.max_attn_logit, {}).get(LOGIT_RULE)
    if series is None:
        return None
    onset = record.run.fault_onset or 0
    starts = [s for s in rule_scores.episodes(series, threshold) if s >= onset]
    return starts[0] if starts else None


def run_short_window_study(
    records: Mapping[str, CampaignRecord],
    rate: float = DEFAULT_FALSE_ALARM_RATE,
    logit_threshold: Optional[float] = None,
    calibration: Sequence[str] = CALIBRATION_RUNS,
) -> dict[str, Any]:
    """Per run: first alarms of both designs by family, the max-logit rule, leads; healthy alarms."""
    table, fit_log = calibrate_short(records, calibration)
    overlap = max(1, math.ceil(DELTA / INTERVAL))
    sample = records[calibration[0]].data.checks
    config = default_sequential_config(INTERVAL)
    out: dict[str, Any] = {
        "rate_per_million": rate, "calibration_runs": list(calibration), "interval": INTERVAL, "delta": DELTA,
        "max_logit_rule_threshold": logit_threshold, "tails": table.to_dict()["tails"], "fit": fit_log,
        "designs": {}, "runs": {},
    }
    # Reported, not assumed: the shipped tails come from runs trained before the CPU pin, so a
    # campaign under the pin reproduces them statistically, not bit for bit (docs/RESULTS.md).
    shipped = load_tail_table().to_dict()["tails"].get(str(overlap), {})
    out["core_tails_equal_shipped"] = all(
        out["tails"][str(overlap)].get(f) == shipped.get(f) for f in CORE_FAMILIES)
    for design, families in DESIGNS.items():
        thresholds, account = thresholds_at_rate(only_families(sample, families), INTERVAL, overlap, rate, table)
        out["designs"][design] = {"tests": account["tests"], "per_test_check_probability":
                                  account["per_test_check_probability"], "thresholds": account["thresholds"]}
        for run_id, record in sorted(records.items()):
            onset = record.run.fault_onset or 0
            replay = replay_pooled(only_families(record.data.checks, families), thresholds, config, start_step=onset)
            entry = out["runs"].setdefault(run_id, {
                "healthy": record.healthy, "seed": record.run.seed, "fa_strength": record.run.fa_strength,
                "onset": record.run.fault_onset, "calibration": run_id in calibration,
                "last_step": record.data.steps[-1] if record.data.steps else None,
                "state": record.status.get("state"), **events(record),
                "max_logit_rule": None if record.healthy else logit_rule_first(record, logit_threshold),
            })
            first, family = earliest_alarm(replay.first_alarm, families)
            attn, _ = earliest_alarm(replay.first_alarm, [f for f in families if f.startswith("attn_")])
            entry[design] = {
                "first_alarm": first, "first_family": family,
                "by_family": {f: replay.first_alarm.get(f) for f in families},
                "attention": attn, "attention_lead_share": lead_share(attn, entry["divergence"], onset),
                "alarms": [[a.step, a.family, a.level, a.kind, list(a.layers)] for a in replay.alarms],
                "first_layers": first_layers(replay.alarms, first, family),
            }
            entry["max_logit_rule_lead_share"] = lead_share(entry["max_logit_rule"], entry["divergence"], onset)
    return out


CHOICE_RUNS = tuple(f"fa-s{strength}-on{onset}-seed{seed}" for strength in (32, 16) for onset in (500, 2000)
                    for seed in (1, 2, 3))
"""The 12 fault runs the design is chosen on (pre-registered, docs/RESULTS.md): FA seeds 1-3."""
FINISHED_STATES = ("done", "stopped-after-divergence")


def _later(a: Optional[int], b: Optional[int]) -> bool:
    """Alarm step ``a`` comes later than ``b`` (no alarm is later than any alarm)."""
    if a is None:
        return b is not None
    return b is not None and a > b


def first_layers(alarms: Sequence[Any], step: Optional[int], family: Optional[str]) -> list[int]:
    """The layers the first alarm names: those of its layer-level alarms at ``step``, else the
    layers that carry its family-level alarm (``PooledAlarm.layers``)."""
    fired = [a for a in alarms if a.step == step and a.family == family]
    own = [a for a in fired if a.level == "layer"] or fired
    return sorted({n for a in own for n in a.layers})


def _layers(design_entry: Mapping[str, Any]) -> str:
    """`` (L2, L3)``: the layers the first alarm names (empty when none)."""
    layers = design_entry.get("first_layers") or []
    return f" (L{', L'.join(str(n) for n in layers)})" if layers else ""


def _after(entry: Mapping[str, Any], design: str) -> str:
    """A design's first alarm on one run as steps after the onset (``-``: none)."""
    first = entry[design]["first_alarm"]
    return "-" if first is None else f"+{first - (entry['onset'] or 0)}"


def choice_verdict(results: Mapping[str, Any], choice_runs: Sequence[str] = CHOICE_RUNS) -> dict[str, Any]:
    """The pre-registered choice (docs/RESULTS.md, "Pre-registration"), applied mechanically.

    ``long+short`` becomes the default only if (1) it raises no alarm on either calibration run,
    (2) its first alarm is never later than ``long``'s on any choice run, (3) earlier on at least
    half of them, and (4) every first alarm it raises on them names an attention family. Returns
    ``{"verdict": "long+short" | "long" | "incomplete", "reasons": [...], "earlier": n, "later": [...]}``;
    ``incomplete`` while a calibration or choice run is missing or unfinished.
    """
    runs = results["runs"]
    missing = [r for r in (*results["calibration_runs"], *choice_runs)
               if r not in runs or runs[r]["state"] not in FINISHED_STATES]
    if missing:
        return {"verdict": "incomplete", "reasons": [f"not finished: {', '.join(missing)}"], "earlier": None,
                "later": []}
    reasons = []
    calib_alarms = {r: len(runs[r]["long+short"]["alarms"]) for r in results["calibration_runs"]}
    if any(calib_alarms.values()):
        reasons.append(f"alarms on calibration runs: {calib_alarms}")
    later = [r for r in choice_runs if _later(runs[r]["long+short"]["first_alarm"], runs[r]["long"]["first_alarm"])]
    if later:
        reasons.append("later than long on " + ", ".join(
            f"{r} ({_after(runs[r], 'long+short')} vs {_after(runs[r], 'long')})" for r in later))
    earlier = sum(_later(runs[r]["long"]["first_alarm"], runs[r]["long+short"]["first_alarm"]) for r in choice_runs)
    if 2 * earlier < len(choice_runs):
        reasons.append(f"earlier than long on {earlier} of {len(choice_runs)} (needs at least half)")
    families = {r: runs[r]["long+short"]["first_family"] for r in choice_runs}
    foreign = [r for r, f in families.items() if f and not f.startswith("attn_")]
    if foreign:
        reasons.append("first alarm not attention on " + ", ".join(foreign))
    return {"verdict": "long" if reasons else "long+short", "reasons": reasons, "earlier": earlier, "later": later}


def markdown(results: Mapping[str, Any], held_out_seeds: Sequence[int] = ()) -> str:
    """The tables of docs/RESULTS.md (short-window study); rows of ``held_out_seeds`` marked."""
    designs = results["designs"]
    lines = [
        f"R = {results['rate_per_million']:g} per 10^6 steps; interval {results['interval']}, delta "
        f"{results['delta']}; calibration runs {', '.join(results['calibration_runs'])}; tests: long "
        f"{designs['long']['tests']}, long+short {designs['long+short']['tests']}; max-logit rule threshold "
        f"{results['max_logit_rule_threshold']}; product-family tails equal to the shipped ones: "
        f"{'yes' if results['core_tails_equal_shipped'] else 'no'}.",
        "",
        "| run | div. | long (today) | long+short | Δ2 long | Δ2 short | dW | max-logit rule | lead long "
        "| lead long+short | lead rule | first alarm <= rule |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(x: Optional[float]) -> str:
        return "-" if x is None else f"{100 * x:.0f} %"

    for run_id, e in results["runs"].items():
        if e["healthy"]:
            continue
        onset = e["onset"] or 0

        def rel(s: Optional[int], onset: int = onset) -> str:
            return "-" if s is None else f"+{s - onset}"

        lo, ls = e["long"], e["long+short"]
        rule = e["max_logit_rule"]
        first = ls["first_alarm"]
        beats = "-" if first is None else ("yes" if rule is None or first <= rule else "no")
        mark = " (held out)" if e["seed"] in held_out_seeds else ""
        lines.append(
            f"| {run_id}{mark} | {rel(e['divergence'])} | {rel(lo['first_alarm'])} {lo['first_family'] or ''}"
            f"{_layers(lo)} | {rel(first)} {ls['first_family'] or ''}{_layers(ls)} "
            f"| {rel(ls['by_family']['attn_delta2'])} "
            f"| {rel(ls['by_family'][SHORT])} | {rel(ls['by_family']['attn_dw'])} | {rel(rule)} "
            f"| {pct(lo['attention_lead_share'])} | {pct(ls['attention_lead_share'])} "
            f"| {pct(e['max_logit_rule_lead_share'])} | {beats} |"
        )
    lines += ["", "Healthy runs (all alarms, any step; * = calibration run):", "",
              "| run | steps | long (today) | long+short |", "|---|---|---|---|"]
    for run_id, e in results["runs"].items():
        if not e["healthy"]:
            continue

        def alarms(d: Mapping[str, Any]) -> str:
            shown = ", ".join(f"{a[0]} {a[1]} {a[3]}" for a in d["alarms"][:3])
            return str(len(d["alarms"])) + (f" ({shown})" if shown else "")

        lines.append(f"| {run_id}{' *' if e['calibration'] else ''} | {e['last_step']} | {alarms(e['long'])} "
                     f"| {alarms(e['long+short'])} |")
    choice = choice_verdict(results)
    lines += ["", f"Pre-registered choice on {len(CHOICE_RUNS)} FA runs (seeds 1-3) and the calibration runs: "
              f"**{choice['verdict']}**" + (" (" + "; ".join(choice["reasons"]) + ")" if choice["reasons"] else "")
              + (f"; long+short earlier on {choice['earlier']} of {len(CHOICE_RUNS)}" if choice["earlier"] is not None
                 else "") + "."]
    return "\n".join(lines) + "\n"
