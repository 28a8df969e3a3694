"""Replay the shipped detector (``detect/null_tails.json`` at a rate R) on recorded healthy runs:
its alarms, and how close each family's CUSUMs came to their levels.

The detector studies refit their own tails on each campaign's calibration runs; this replay keeps
the tails the package ships, so its answer is what a user with the default settings would have
seen. Records from any campaign work (``campaign_records.load_records``); streams of families the
shipped table does not cover (``attn_delta2_short``) are dropped first. The margins are the
largest layer-level and family-level CUSUM of each family over the run against its warning and
alarm levels: a run whose CUSUM stays under the warning never freezes a baseline, so a small
margin there is a near miss (docs/RESULTS.md, "Healthy runs"). ``replay_healthy`` (with
``FamilyMargin``, ``DetectorReplay`` and ``closest_margin``, in the product:
``mechmon_megatron.calibrate.replay``) does the same with any tail table (the leave-one-out check
uses it for its held-out runs); ``fault_row`` puts a fault run's first alarms beside the max-logit
rule (``logit_rule_threshold``: its most sensitive threshold quiet on every healthy run of a set of
records; ``logit_rule_first``: its first episode after the onset). Needs numpy (the rule scores).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from mechmon_megatron.calibrate.replay import (
    CORE_FAMILIES,
    Checks,
    DetectorReplay,
    closest_margin,
    replay_healthy,
    subsample,
)
from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, TailTable, load_tail_table
from mechmon_megatron.detect.phase_moments import PhaseTable, TrainingSchedule, select_phase_table
from mechmon_megatron.research.study import rule_scores
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.detector_report import events, lead_share, operating_index, symptom_sweeps
from mechmon_megatron.research.study.scenarios import schedule_of_flags
from mechmon_megatron.session.detector_inputs import attention_kind, stream_family

RECORDED_INTERVAL = 20
"""Steps between the recorded checks of the detector and short-window studies."""
RECORDED_DELTA = 100
"""Window (steps) of those records; interval 100 replays every fifth check (non-overlapping)."""
LOGIT_RULE = "max_attn_logit"
"""The symptom rule the detector's first alarms are set beside (``rule_scores``)."""


def only_families(checks: Checks, families: Sequence[str]) -> list[tuple[int, dict[str, float]]]:
    """The checks with every detector stream outside ``families`` removed (other scalars kept)."""
    keep = set(families)
    out = []
    for step, scalars in checks:
        out.append((step, {k: v for k, v in scalars.items() if (f := stream_family(k)) is None or f in keep}))
    return out


def logit_rule_threshold(records: Mapping[str, CampaignRecord]) -> Optional[float]:
    """The max-logit rule's most sensitive threshold with no alarm on any healthy run of ``records``."""
    healthy_steps = sum(r.data.steps[-1] for r in records.values() if r.healthy and r.data.steps)
    sweep = symptom_sweeps(records)[LOGIT_RULE]
    idx = operating_index(sweep, healthy_steps, None)
    return None if idx is None else float(sweep.thresholds[idx])


def logit_rule_first(record: CampaignRecord, threshold: Optional[float]) -> Optional[int]:
    """First alarm episode of the max-logit rule that starts at or after the onset."""
    return None if threshold is None else logit_rule_after(record.data, threshold, record.run.fault_onset)


def logit_rule_after(data: Any, threshold: float, onset: Optional[int]) -> Optional[int]:
    """First alarm episode of the max-logit rule at ``threshold`` that starts at or after ``onset``
    (the whole run for None) in ``data`` (``steps``, ``loss``, ``grad_norm``, ``max_attn_logit``
    per step: a record's data or a study run's); None when it never fires or there is no logit."""
    series = rule_scores.rule_scores(data.steps, data.loss, data.grad_norm, data.max_attn_logit, {}).get(LOGIT_RULE)
    if series is None:
        return None
    starts = [s for s in rule_scores.episodes(series, threshold) if s >= (onset or 0)]
    return starts[0] if starts else None


def record_schedule(record: CampaignRecord) -> TrainingSchedule:
    """The learning-rate schedule a study run was trained with (``scenarios.schedule_of_flags``)."""
    return schedule_of_flags(record.run.flags)


def record_phase(record: CampaignRecord, table: TailTable, interval: int = RECORDED_INTERVAL) -> Optional[PhaseTable]:
    """The phase moments of ``table`` a session would apply to ``record`` checked every ``interval``
    steps: its check and learning-rate schedule and attention kind (None: uncorrected)."""
    phase, _ = select_phase_table(table.phase, interval, RECORDED_DELTA, record_schedule(record),
                                  attention_kind(record.data.checks))
    return phase


def replay_shipped(record: CampaignRecord, interval: int = RECORDED_INTERVAL,
                   rate: float = DEFAULT_FALSE_ALARM_RATE, table: Optional[TailTable] = None) -> DetectorReplay:
    """The shipped detector on ``record`` at ``interval`` (a multiple of :data:`RECORDED_INTERVAL`;
    overlap ``ceil(RECORDED_DELTA / interval)``); ``table`` defaults to the shipped tails, and its
    phase moments apply where they match the record's check and learning-rate schedule."""
    if interval % RECORDED_INTERVAL:
        raise ValueError(f"interval must be a multiple of {RECORDED_INTERVAL}, got {interval}")
    every = interval // RECORDED_INTERVAL
    overlap = max(1, -(-RECORDED_DELTA // interval))
    checks = subsample(only_families(record.data.checks, CORE_FAMILIES), RECORDED_INTERVAL, every)
    table = table or load_tail_table()
    out = replay_healthy(checks, interval, overlap, table, record.run.run_id, rate,
                         phase=record_phase(record, table, interval))
    out.steps = record.data.steps[-1] if record.data.steps else 0
    return out


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
