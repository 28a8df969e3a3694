"""Replay the shipped detector (``detect/null_tails.json`` at a rate R) on recorded healthy runs:
its alarms, and how close each family's CUSUMs came to their levels.

The detector studies refit their own tails on each campaign's calibration runs; this replay keeps
the tails the package ships, so its answer is what a user with the default settings would have
seen. Records from any campaign work (``campaign_records.load_records``); streams of families the
shipped table does not cover (``attn_delta2_short``) are dropped first. The margins are the
largest layer-level and family-level CUSUM of each family over the run against its warning and
alarm levels: a run whose CUSUM stays under the warning never freezes a baseline, so a small
margin there is a near miss (docs/RESULTS.md, "Healthy runs"). ``replay_healthy`` does the same
with any tail table (``calibration_check`` uses it for its held-out runs); ``fault_row`` puts a
fault run's first alarms beside the max-logit rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, TailTable, load_tail_table
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.detector_report import events, lead_share
from mechmon_megatron.research.study.pooled_replay import (
    CORE_FAMILIES,
    Checks,
    replay_pooled,
    subsample,
    thresholds_at_rate,
)
from mechmon_megatron.research.study.short_window_study import logit_rule_first, only_families

RECORDED_INTERVAL = 20
"""Steps between the recorded checks of the detector and short-window studies."""
RECORDED_DELTA = 100
"""Window (steps) of those records; interval 100 replays every fifth check (non-overlapping)."""


@dataclass(frozen=True, slots=True)
class FamilyMargin:
    """Largest CUSUM of one family's tests over a run, against the levels (CUSUM units)."""

    level: str
    """``layer`` (the largest over its layers) or ``family`` (the pooled test)."""
    largest: float
    layer: Optional[int]
    """The layer that reached ``largest`` (layer level only)."""
    step: int
    warning: float
    alarm: float


@dataclass
class DetectorReplay:
    """One run under the detector at one schedule (its alarms and its families' margins)."""

    run_id: str
    interval: int
    steps: int
    alarms: list[dict[str, Any]] = field(default_factory=list)
    """Each: step, family, level, layers, statistic, threshold, change_step."""
    margins: dict[str, list[FamilyMargin]] = field(default_factory=dict)
    misfits: list[list[Any]] = field(default_factory=list)
    """[step, family] where the calibration misfit counter fired, as the session's would."""


def replay_healthy(checks: Checks, interval: int, overlap: int, table: TailTable, run_id: str = "",
                   rate: float = DEFAULT_FALSE_ALARM_RATE) -> DetectorReplay:
    """The detector with ``table``'s thresholds at ``rate`` on one run's ``checks`` (already at
    ``interval``, families the table covers only), its misfit counter on as in the session: its
    alarms, misfits and every family's margins."""
    thresholds, account = thresholds_at_rate(checks, interval, overlap, rate, table)
    replay = replay_pooled(checks, thresholds, default_sequential_config(interval),
                           warning_probability=account["warning_per_test_check_probability"])
    out = DetectorReplay(run_id=run_id, interval=interval, steps=checks[-1][0] if checks else 0,
                         misfits=[list(m) for m in replay.misfits])
    out.alarms = [{"step": a.step, "family": a.family, "level": a.level, "layers": list(a.layers),
                   "statistic": a.statistic, "threshold": a.threshold, "change_step": a.change_step}
                  for a in replay.alarms]
    for family, levels in thresholds.items():
        for level in ("layer", "family"):
            keys = [k for k in replay.statistics if k.split("/", 1)[0] == family
                    and (("/layer_" in k) == (level == "layer"))]
            if not keys:
                continue
            best = max(((v, s, k) for k in keys for s, v in replay.statistics[k]), key=lambda t: t[0])
            layer = int(best[2].rsplit("_", 1)[1]) if level == "layer" else None
            t = getattr(levels, level)
            out.margins.setdefault(family, []).append(
                FamilyMargin(level=level, largest=best[0], layer=layer, step=best[1], warning=t.warning,
                             alarm=t.alarm))
    return out


def replay_shipped(record: CampaignRecord, interval: int = RECORDED_INTERVAL,
                   rate: float = DEFAULT_FALSE_ALARM_RATE, table: Optional[TailTable] = None) -> DetectorReplay:
    """The shipped detector on ``record`` at ``interval`` (a multiple of :data:`RECORDED_INTERVAL`;
    overlap ``ceil(RECORDED_DELTA / interval)``); ``table`` defaults to the shipped tails."""
    if interval % RECORDED_INTERVAL:
        raise ValueError(f"interval must be a multiple of {RECORDED_INTERVAL}, got {interval}")
    every = interval // RECORDED_INTERVAL
    overlap = max(1, -(-RECORDED_DELTA // interval))
    checks = subsample(only_families(record.data.checks, CORE_FAMILIES), RECORDED_INTERVAL, every)
    out = replay_healthy(checks, interval, overlap, table or load_tail_table(), record.run.run_id, rate)
    out.steps = record.data.steps[-1] if record.data.steps else 0
    return out


def closest_margin(replay: DetectorReplay) -> tuple[str, FamilyMargin]:
    """The family and layer-level margin whose largest CUSUM came closest to (or past) its warning."""
    return max(((f, m) for f, ms in replay.margins.items() for m in ms if m.level == "layer"),
               key=lambda fm: fm[1].largest / fm[1].warning)


def markdown(replays: Sequence[DetectorReplay]) -> str:
    """One row per run and schedule: alarms, and the family whose layer CUSUM came closest to its
    warning level (largest / warning / alarm)."""
    lines = ["| run | interval | alarms | closest layer CUSUM to its warning (largest / warning / alarm) |",
             "|---|---|---|---|"]
    for r in replays:
        alarms = "; ".join(f"{a['family']} {a['level']} {a['layers']} at {a['step']} ({a['statistic']:.2f} > "
                           f"{a['threshold']:.2f})" for a in r.alarms) or "0"
        family, m = closest_margin(r)
        lines.append(f"| {r.run_id} | {r.interval} | {alarms} | {family} layer {m.layer} at {m.step}: "
                     f"{m.largest:.1f} / {m.warning:.1f} / {m.alarm:.1f} |")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class FaultRow:
    """One fault run under the shipped detector, beside the max-logit rule (steps)."""

    run_id: str
    onset: int
    divergence: Optional[int]
    first_alarm: Optional[int]
    """First alarm at or after the onset, any family."""
    first_family: Optional[str]
    delta2: Optional[int]
    dw: Optional[int]
    rule: Optional[int]
    """First episode of the max-logit rule at or after the onset."""
    alarms_before_onset: int
    lead: Optional[float]
    """(divergence - first alarm) / (divergence - onset); None without both or after divergence."""


def fault_row(record: CampaignRecord, rule_threshold: Optional[float],
              rate: float = DEFAULT_FALSE_ALARM_RATE) -> FaultRow:
    """The shipped detector (interval 20) and the max-logit rule at ``rule_threshold`` on a fault run."""
    onset = record.run.fault_onset or 0
    alarms = replay_shipped(record, RECORDED_INTERVAL, rate).alarms
    after = [a for a in alarms if a["step"] >= onset]

    def first(families: tuple[str, ...]) -> Optional[int]:
        return next((a["step"] for a in after if a["family"] in families), None)

    divergence = events(record)["divergence"]
    first_step = after[0]["step"] if after else None
    return FaultRow(run_id=record.run.run_id, onset=onset, divergence=divergence, first_alarm=first_step,
                    first_family=after[0]["family"] if after else None, delta2=first(("attn_delta2",)),
                    dw=first(("attn_dw",)), rule=logit_rule_first(record, rule_threshold),
                    alarms_before_onset=len(alarms) - len(after), lead=lead_share(first_step, divergence, onset))


def fault_markdown(rows: Sequence[FaultRow], rule_threshold: Optional[float]) -> str:
    """The table of docs/RESULTS.md, "Fault runs at the session default" (held-out seeds)."""
    def s(x: Optional[int]) -> str:
        return "-" if x is None else str(x)

    lines = [f"| run | onset | diverge | first alarm (family) | Δ2 | dW | max-logit rule ({rule_threshold:g}) | lead "
             "| first alarm no later than the rule |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lead = "-" if r.lead is None else f"{100 * r.lead:.0f} %"
        no_later = "-" if r.first_alarm is None else ("yes" if r.rule is None or r.first_alarm <= r.rule else "no")
        lines.append(f"| {r.run_id} | {r.onset} | {s(r.divergence)} | {s(r.first_alarm)} ({r.first_family or '-'}) | "
                     f"{s(r.delta2)} | {s(r.dw)} | {s(r.rule)} | {lead} | {no_later} |")
    return "\n".join(lines)
