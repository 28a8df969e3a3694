"""The demo's first table: mechmon beside the max-attention-logit rule on equal footing.

Both at one false-alarm rate: mechmon at the session default (R = 0.01 false alarms per 10^6 steps,
10^-4 per 10,000-step run), the rule at the threshold the same per-run rate gives under the Gumbel
law of its per-run maxima on the healthy 10,000-step design records (docs/METHOD.md section 8c,
``early_phase_report.rule_thresholds``). The second rule column, its most sensitive threshold that
stayed quiet on those records, is not extrapolated to any rate: an unequal comparison, kept
because it is what a user tuning the rule by eye would set. Needs numpy (the rule scores).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from mechmon_megatron.research.study.analysis import MECHMON_FAMILIES, RunData
from mechmon_megatron.research.study.early_phase_report import RuleThresholds
from mechmon_megatron.research.study.shipped_replay import logit_rule_after

__all__ = ["footing_lines"]


def _mechmon_first(run: Mapping[str, Any]) -> tuple[Optional[int], str]:
    onset = run.get("fault_onset") or 0
    alarms = [(step, family) for family in MECHMON_FAMILIES
              if (step := run["first_alarm"].get(family)) is not None and step >= onset]
    return min(alarms) if alarms else (None, "")


def _fmt(step: Optional[int]) -> str:
    return "-" if step is None else str(step)


def footing_lines(runs: Sequence[Mapping[str, Any]], data: Mapping[str, RunData], rules: RuleThresholds) -> list[str]:
    """The markdown table (one row per run) and one line per fault run saying who was first."""
    lines = [
        "## mechmon beside the max-attention-logit rule, on equal footing",
        "",
        f"| run | onset | mechmon (R = 0.01: 1e-4 per 10,000-step run) | max-logit rule >= {rules.equal:.2f} x "
        f"(the same rate, Gumbel fit of {rules.healthy_runs} healthy runs) | max-logit rule >= {rules.quiet:g} x "
        "(quiet on those runs, not extrapolated: unequal) |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for run in runs:
        onset = run.get("fault_onset")
        first, family = _mechmon_first(run)
        d = data[run["run_id"]]
        equal, quiet = logit_rule_after(d, rules.equal, onset), logit_rule_after(d, rules.quiet, onset)
        label = f"{run['scenario']} seed {run['seed']}"
        false = "!" if onset is None else ""  # a clean run: any alarm is a false one
        lines.append(f"| {label} | {_fmt(onset)} | {_fmt(first)}{false if first is not None else ''}"
                     f"{f' ({family})' if family else ''} | {_fmt(equal)}{false if equal is not None else ''} "
                     f"| {_fmt(quiet)}{false if quiet is not None else ''} |")
        if onset is None:
            continue
        if first is not None and (equal is None or first <= equal):
            verdicts.append(f"{label}: mechmon first on equal footing ({_fmt(first)} against {_fmt(equal)}).")
        else:
            verdicts.append(f"{label}: the rule first on equal footing ({_fmt(equal)} against mechmon "
                            f"{_fmt(first)}).")
    return [*lines, "", *verdicts]
