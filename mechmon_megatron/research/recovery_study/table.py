"""The markdown table of the recovery study from its JSON records (``docs/data/recovery_study``)."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from mechmon_megatron.research.recovery_study.campaign import OPERATORS, TARGET_LOSS_GAP


def load_records(dest: str) -> list[dict[str, Any]]:
    if not os.path.isdir(dest):
        return []
    out = []
    for name in sorted(os.listdir(dest)):
        if name.endswith(".json"):
            with open(os.path.join(dest, name), encoding="utf-8") as f:
                out.append(json.load(f))
    return out


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def _loss(x: Optional[float]) -> str:
    return "diverged" if x is None else f"{x:.3f}"


def _what(op: str, body: dict[str, Any]) -> str:
    if op == "mechmon":
        recs = [r for r in body.get("recovery", []) if r.get("action") == "relaunch"]
        parts = []
        for r in recs:
            a, c = r.get("alert") or {}, r.get("checkpoint") or {}
            parts.append(f"{a.get('family')} alarm {a.get('iteration')} (cp {a.get('first_warning_step')}) -> "
                         f"{c.get('name')}{' AFTER cp' if r.get('after_change_point') else ''}, {r.get('remedy')}")
        none = "no alarm" + (" so far" if body.get("status") == "unfinished" else "")
        return "; ".join(parts) or (none if not body.get("alarms") else "alarm, no relaunch")
    if op == "practice":
        spikes = body.get("spikes", [])
        return "; ".join(f"{s['rule']} at {s['spike']} -> {s['to']}, skip {s['skipped'][0]}-{s['skipped'][1]}"
                         for s in spikes) or "no spike rule fired"
    alarms = body.get("alarms", [])
    first = alarms[0].split("ALARM at iteration", 1)[1].split(":")[0].strip() if alarms else None
    if first is None and body.get("log_mode_alarm_steps"):
        first = str(body["log_mode_alarm_steps"][0])
    div = body.get("divergence_step")
    what = f"diverged at {div}" if div else "no divergence"
    return what + (f"; first mechmon alarm (log mode) {first}" if first else "")


def markdown_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| run | operator | restarts | steps discarded | extra wall [s] | cause removed | what happened | "
        "loss (last 100 steps) | vs clean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for rec in records:
        for op in OPERATORS:
            body = rec["operators"].get(op, {})
            if body.get("status") == "unfinished":
                lines.append(f"| {rec['cell']} | {op} | unfinished: {body['restarts']} so far | | | | "
                             f"{_what(op, body)}; reached step {body['last_step']} | | |")
                continue
            if body.get("status") != "done":
                lines.append(f"| {rec['cell']} | {op} | {body.get('status', 'not run')} | | | | | | |")
                continue
            lines.append(
                f"| {rec['cell']} | {op} | {body['restarts']} | {body['steps_discarded']} | "
                f"{body['extra_wall_s']:.0f} | {body['cause_removed']} | {_what(op, body)} | "
                f"{_loss(body['loss_smoothed'])} | {_pct(body['loss_vs_clean'])} |")
            if op == "mechmon":
                verdicts.append((rec["cell"], bool(body.get("recovered"))))
        clean = rec["clean_loss_smoothed"]
        lines.append(f"| {rec['cell']} | clean | | | | | | {'not finished' if clean is None else f'{clean:.3f}'} | |")
    met = [c for c, ok in verdicts if ok]
    lines += ["", f"Target (mechmon's loop recovers every run with at most one restart, within "
                  f"{100 * TARGET_LOSS_GAP:.0f} % of the clean loss): "
                  + (f"met on {len(met)} of the {len(verdicts)} mechmon runs that finished" if verdicts
                     else "no mechmon run finished")
                  + (f" (not met: {', '.join(c for c, ok in verdicts if not ok)})" if len(met) < len(verdicts) else "")]
    return "\n".join(lines)
