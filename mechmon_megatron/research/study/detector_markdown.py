"""Markdown tables of the detector study (``results.json`` of ``detector_report``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

FAMILY_SHORT = {"attn_delta2": "Δ2", "attn_dw": "dW", "router_entropy": "r-ent", "router_weights": "r-sim"}
RULE_ORDER = (
    "mechmon attn_delta2",
    "mechmon attn_dw",
    "mechmon router_entropy",
    "mechmon router_weights",
    "loss_6sigma",
    "loss_10x",
    "loss_2x_mean",
    "grad_norm_6sigma",
    "max_attn_logit",
    "wq_spectral_norm",
)


def _s(x: Optional[float], fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def healthy_table(results: Mapping[str, Any]) -> str:
    lines = [
        "| healthy run | schedule | steps | used for calibration | alarms (R = 0.01, interval 20) | "
        "alarms (interval 100) |",
        "|---|---|---|---|---|---|",
    ]
    for run_id, r in sorted(results["runs"].items()):
        if r["kind"] != "healthy":
            continue
        lines.append(
            f"| {run_id} | {r['schedule']} | {r['steps']} | {'yes' if r['calibration'] else 'no (held out)'} | "
            f"{len(r['alarms_default'])} | {len(r['alarms_default_interval_100'])} |"
        )
    return "\n".join(lines)


def _who(alarm: Mapping[str, Any]) -> str:
    """``Δ2 layer L1 head_0 head_2``: family, level, layers and the members that carry it."""
    family = FAMILY_SHORT.get(alarm["family"], alarm["family"])
    layers = ",".join(map(str, alarm["layers"]))
    members = f" {' '.join(alarm['members'])}" if alarm["members"] and alarm["members"] != [""] else ""
    return f"{family} {alarm['level']} L{layers}{members}"


def fault_table(results: Mapping[str, Any]) -> str:
    lines = [
        "| run | onset | diverge | collapse | Δ2 | dW | r-ent | r-sim | Δ2/dW @100 | attention lead "
        "| first alarm names |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_id, r in sorted(results["runs"].items(), key=lambda kv: (kv[1]["group"] or "", kv[1]["seed"])):
        if r["kind"] == "healthy":
            continue
        first = r["first_alarm_default"]
        at100 = r["first_alarm_default_interval_100"]
        a100 = [v for v in (at100["attn_delta2"], at100["attn_dw"]) if v is not None]
        onset = r["onset"] or 0
        named = next((a for a in r["alarms_default"] if a["step"] >= onset), None)
        who = "-" if named is None else _who(named)
        lead = r["attention_lead_share"]
        lead_steps = (
            None if r["attention_alarm"] is None or r["divergence"] is None else r["divergence"] - r["attention_alarm"]
        )
        lines.append(
            f"| {run_id} | {r['onset']} | {_s(r['divergence'])} | {_s(r['collapse'])} | "
            + " | ".join(_s(first[f]) for f in FAMILY_SHORT)
            + f" | {_s(min(a100) if a100 else None)} | "
            + (f"{lead_steps} ({_pct(lead)})" if lead is not None else "-")
            + f" | {who} |"
        )
    return "\n".join(lines)


def comparison_table(results: Mapping[str, Any], level: str) -> str:
    comp = results["comparison"][level]
    runs = {k: v for k, v in results["runs"].items() if v["kind"] != "healthy"}
    groups: dict[str, list[str]] = {}
    for run_id, r in sorted(runs.items()):
        groups.setdefault(r["group"], []).append(run_id)
    header = "| rule | threshold | healthy FA / 10^6 steps | " + " | ".join(sorted(groups)) + " |"
    lines = [header, "|" + "---|" * (3 + len(groups))]
    for rule in RULE_ORDER:
        entry = comp.get(rule)
        if entry is None:
            lines.append(f"| {rule} | never quiet at this level | | " + " | ".join("" for _ in groups) + " |")
            continue
        cells = []
        for group in sorted(groups):
            delays = []
            for run_id in groups[group]:
                step = entry["first_alarm"].get(run_id)
                onset = runs[run_id]["onset"] or 0
                delays.append("miss" if step is None else str(step - onset))
            cells.append(" / ".join(delays))
        threshold = entry["threshold"]
        lines.append(f"| {rule} | {threshold:g} | {entry['healthy_far_per_million']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_table(results: Mapping[str, Any]) -> str:
    t = results["targets"]
    leads = t["fa_attention_lead_share"]
    rows = [
        (
            "zero alarms on every healthy run (default R, interval 20)",
            "met" if t["zero_healthy_alarms"] else "NOT met",
            ", ".join(f"{k}: {v}" for k, v in sorted(t["healthy_alarms_at_default"].items())),
        ),
        (
            "FA attention lead >= 75 % on every 32/16-ulp run",
            "met" if t["fa_lead_ge_75pct_every_seed"] else "NOT met",
            ", ".join(f"{k}: {_pct(v)}" for k, v in sorted(leads.items())),
        ),
        (
            "FA: earlier than max logit and W_q norm at equal (zero) FA rate",
            "met"
            if t["fa_earlier_than_logit_and_wq_at_zero_far"]
            and all(t["fa_earlier_than_logit_and_wq_at_zero_far"].values())
            else "NOT met",
            ", ".join(
                f"{k}: {'yes' if v else 'no'}" for k, v in sorted(t["fa_earlier_than_logit_and_wq_at_zero_far"].items())
            ),
        ),
        (
            "router-only LR: routing-entropy alarm on every seed",
            "met" if t["router_only_entropy_alarm_every_seed"] else "NOT met",
            "",
        ),
        (
            "router-only LR: no attention alarm before divergence",
            "met" if not any(t["router_only_attention_alarm_before_divergence"].values()) else "NOT met",
            ", ".join(
                f"{k}: {'alarm' if v else 'quiet'}"
                for k, v in sorted(t["router_only_attention_alarm_before_divergence"].items())
            ),
        ),
        ("detector cost per check", f"{t['detector_us_per_check']:.0f} µs", "pure Python, all families of this model"),
    ]
    lines = ["| target | result | detail |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def markdown_detector_report(results: Mapping[str, Any]) -> str:
    parts = [
        "# mechmon detector study",
        f"Healthy steps: {results['healthy_steps']}; calibration runs: {', '.join(results['calibration_runs'])}; "
        f"detector default R = {results['default_rate']} false alarms per 10^6 steps.",
        "## Targets",
        targets_table(results),
        "## Healthy runs",
        healthy_table(results),
        "## Fault runs at the session default",
        fault_table(results),
    ]
    for level in results["comparison"]:
        parts += [
            f"## Detection delay (steps after onset) at equal false-alarm rate: {level}",
            comparison_table(results, level),
        ]
    return "\n\n".join(parts) + "\n"
