"""``results.json`` and the markdown report of a fault study (table, orthogonality, targets).

Table columns (steps; ``-`` = never; ``!`` marks an alarm on a clean run or before the onset, a
false alarm): onset, loss divergence, expert collapse, the four mechmon families
(``attn_delta2``, ``attn_dw``, ``router_entropy``, ``router_weights``), the symptom baselines, and
the leads ``divergence - alarm`` with their share of ``divergence - onset``.

Orthogonality matrix (fault family x monitor family): how many runs raised an alarm of the
monitor family at or after the onset and before the loss divergence (after divergence every
signal moves, so those alarms attribute nothing); the number after ``/`` is the run count.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

from mechmon_megatron.research.study.analysis import (
    ALARM_KEYS,
    ATTN_FAMILIES,
    MECHMON_FAMILIES,
    ROUTER_FAMILIES,
    SYMPTOM_KEYS,
)

_SHORT = {
    "attn_delta2": "Δ2",
    "attn_dw": "dW",
    "router_entropy": "r-ent",
    "router_weights": "r-sim",
    "loss_6sigma": "loss 6σ",
    "loss_10x": "loss 10x",
    "loss_2x_mean": "loss 2x",
    "grad_norm_6sigma": "gnorm 6σ",
    "max_attn_logit": "max-logit",
    "wq_spectral_norm": "Wq σmax",
}

FAULT_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attn fault (fa)", ("fa",)),
    ("router fault (moe-lr, moe-gbs)", ("moe-lr", "moe-gbs")),
    ("router-only LR fault (moe-router-lr)", ("moe-router-lr",)),
    ("both (combined)", ("combined",)),
    ("none (clean)", ("clean",)),
)
MONITOR_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention monitors (Δ2, dW)", ATTN_FAMILIES),
    ("router monitors (entropy, similarity)", ROUTER_FAMILIES),
)


def _fmt_step(step: Optional[int], false_alarm: bool = False) -> str:
    if step is None:
        return "-"
    return f"{step}!" if false_alarm else str(step)


def _fmt_lead(lead: dict[str, Any]) -> str:
    if lead.get("steps") is None:
        return "-"
    share = lead.get("share")
    return f"{lead['steps']} ({share:.0%})" if share is not None else str(lead["steps"])


def reported_runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if not r.get("calibration")]


def attributable_alarm(run: dict[str, Any], families: Sequence[str]) -> bool:
    """Whether any family alarmed at/after the onset and before divergence (clean: ever).
    Router families use the run's ``router_fault_onset`` when it has one (``combined``)."""
    end = run.get("divergence_step")
    for family in families:
        onset = run.get("fault_onset")
        if family in ROUTER_FAMILIES and run.get("router_fault_onset") is not None:
            onset = run["router_fault_onset"]
        step = run["first_alarm"].get(family)
        if step is None or step < (0 if onset is None else onset):
            continue
        if end is None or step < end:
            return True
    return False


def orthogonality(results: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    """``{fault row: {monitor column: [alarmed runs, runs]}}`` over the reported runs."""
    matrix: dict[str, dict[str, list[int]]] = {}
    runs = reported_runs(results)
    for row, scenarios in FAULT_ROWS:
        chosen = [r for r in runs if r["scenario"] in scenarios]
        if not chosen:
            continue
        matrix[row] = {
            col: [sum(attributable_alarm(r, fams) for r in chosen), len(chosen)] for col, fams in MONITOR_COLUMNS
        }
    return matrix


def _before(a: Optional[int], b: Optional[int]) -> bool:
    """a strictly before b, where a missing b counts as 'never' (so any a is before it)."""
    return a is not None and (b is None or a < b)


def evaluate_targets(results: dict[str, Any]) -> dict[str, Any]:
    """The study's targets, checked run by run, with the numbers behind each verdict."""
    runs = reported_runs(results)
    out: dict[str, Any] = {}
    fa_rows = []
    for r in (x for x in runs if x["scenario"] == "fa"):
        fa, div = r["first_alarm"], r["divergence_step"]
        onset = r["fault_onset"] or 0
        share = r["lead_to_divergence"]["attn_delta2"]["share"]
        # Symptom alarms before the onset are false alarms (listed apart), not earlier warnings.
        after = {k: fa[k] for k in SYMPTOM_KEYS if fa[k] is not None and fa[k] >= onset}
        fa_rows.append(
            {
                "seed": r["seed"],
                "order_delta2_dw_divergence": div is not None
                and _before(fa["attn_delta2"], fa["attn_dw"])
                and _before(fa["attn_dw"], div),
                "delta2_lead_share": share,
                "delta2_lead_share_ge_50pct": share is not None and share >= 0.5,
                "delta2_before_every_symptom": fa["attn_delta2"] is not None
                and fa["attn_delta2"] >= onset
                and all(fa["attn_delta2"] < v for v in after.values()),
                "earliest_symptom_after_onset": min(after.values()) if after else None,
                "earliest_symptom_after_onset_name": min(after, key=after.get) if after else None,
                "symptom_false_alarms_before_onset": {
                    k: fa[k] for k in SYMPTOM_KEYS if fa[k] is not None and fa[k] < onset
                },
                "delta2_alarm": fa["attn_delta2"],
                "divergence_step": div,
            }
        )
    out["fa"] = fa_rows
    moe_rows = []
    for r in (x for x in runs if x["scenario"] in ("moe-lr", "moe-gbs", "moe-router-lr")):
        ent, col, div = r["first_alarm"]["router_entropy"], r["expert_collapse_step"], r["divergence_step"]
        moe_rows.append(
            {
                "scenario": r["scenario"],
                "seed": r["seed"],
                "router_entropy_alarm": ent,
                "expert_collapse_step": col,
                "divergence_step": div,
                # None (n/a) when the event never happened: the target cannot be judged.
                "before_collapse": None if col is None else (ent is not None and ent < col),
                "before_divergence": None if div is None else (ent is not None and ent < div),
            }
        )
    out["moe"] = moe_rows
    clean = [r for r in runs if r["scenario"] == "clean"]
    faulty_iters = max((r["train_iters"] for r in runs if r["scenario"] != "clean"), default=0)
    out["clean"] = {
        "seeds": [r["seed"] for r in clean],
        "runs_with_mechmon_alarm": [
            r["seed"] for r in clean if any(r["first_alarm"][f] is not None for f in MECHMON_FAMILIES)
        ],
        "min_steps": min((r["train_iters"] for r in clean), default=0),
        "faulty_run_steps": faulty_iters,
    }
    # A clean run that raised no alarm passes; whether the study had enough clean runs (>= 3
    # seeds, as long as the faulty runs) to make the pass convincing is reported apart.
    out["clean"]["met"] = (not out["clean"]["runs_with_mechmon_alarm"]) if clean else None
    out["clean"]["enough_runs"] = (len(clean) >= 3 and out["clean"]["min_steps"] >= faulty_iters) if clean else None
    matrix = orthogonality(results)
    fa_router = matrix.get(FAULT_ROWS[0][0], {}).get(MONITOR_COLUMNS[1][0], [0, 0])
    moe_attn = matrix.get(FAULT_ROWS[1][0], {}).get(MONITOR_COLUMNS[0][0], [0, 0])
    out["orthogonality"] = {
        "fa_runs_with_router_alarm": fa_router,
        "moe_runs_with_attention_alarm": moe_attn,
        # None when the study lacks fa or moe-* runs: the target is not measured.
        "met": (fa_router[0] == 0 and moe_attn[0] == 0) if fa_router[1] and moe_attn[1] else None,
    }
    return out


def markdown_table(results: dict[str, Any]) -> str:
    keys = list(ALARM_KEYS)
    head = ["scenario", "seed", "onset", "diverge", "collapse"] + [_SHORT[k] for k in keys]
    head += ["Δ2 lead", "dW lead", "r-ent lead→collapse"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in reported_runs(results):
        fa, false = r["first_alarm"], r.get("false_alarm", {})
        cells = [r["scenario"], str(r["seed"]), _fmt_step(r["fault_onset"]), _fmt_step(r["divergence_step"]),
                 _fmt_step(r["expert_collapse_step"])]
        cells += [_fmt_step(fa[k], bool(false.get(k))) for k in keys]
        cells += [
            _fmt_lead(r["lead_to_divergence"]["attn_delta2"]),
            _fmt_lead(r["lead_to_divergence"]["attn_dw"]),
            _fmt_lead(r["lead_to_collapse"]["router_entropy"]),
        ]
        if r.get("returncode"):
            cells[0] += f" (exit {r['returncode']})"
        elif r.get("steps_recorded", 0) < r["train_iters"]:
            cells[0] += f" (stopped at {r.get('steps_recorded', 0)})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_orthogonality(results: dict[str, Any]) -> str:
    matrix = orthogonality(results)
    head = ["fault \\ monitor"] + [c for c, _ in MONITOR_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, cols in matrix.items():
        lines.append("| " + " | ".join([row] + [f"{a}/{n}" for a, n in cols.values()]) + " |")
    return "\n".join(lines)


def markdown_targets(results: dict[str, Any]) -> str:
    t = results.get("targets") or evaluate_targets(results)
    lines = []
    for row in t["fa"]:
        share = row["delta2_lead_share"]
        lines.append(
            f"- fa seed {row['seed']}: Δ2 < dW < divergence: {_yes(row['order_delta2_dw_divergence'])}; "
            f"Δ2 lead share {('-' if share is None else f'{share:.0%}')} (target >= 50%: "
            f"{_yes(row['delta2_lead_share_ge_50pct'])}); Δ2 before every symptom baseline: "
            f"{_yes(row['delta2_before_every_symptom'])} (Δ2 {_fmt_step(row['delta2_alarm'])}, earliest "
            f"symptom after onset {_fmt_step(row['earliest_symptom_after_onset'])} "
            f"{row['earliest_symptom_after_onset_name'] or ''}; false alarms before onset: "
            f"{row['symptom_false_alarms_before_onset'] or 'none'})"
        )
    for row in t["moe"]:
        lines.append(
            f"- {row['scenario']} seed {row['seed']}: router-entropy alarm {_fmt_step(row['router_entropy_alarm'])}, "
            f"collapse {_fmt_step(row['expert_collapse_step'])}, divergence {_fmt_step(row['divergence_step'])}: "
            f"before collapse {_yes(row['before_collapse'])}, before divergence "
            f"{_yes(row['before_divergence'])}"
        )
    c = t["clean"]
    lines.append(
        f"- clean: {len(c['seeds'])} seeds, runs with a mechmon alarm: {c['runs_with_mechmon_alarm'] or 'none'}, "
        f"{c['min_steps']} steps (faulty runs {c['faulty_run_steps']}): no false alarm {_yes(c['met'])}"
        + ("" if c.get("enough_runs") is not False else " (fewer than 3 clean seeds or shorter than the faulty runs)")
    )
    o = t["orthogonality"]
    lines.append(
        f"- orthogonality: fa runs with a router alarm {o['fa_runs_with_router_alarm'][0]}/"
        f"{o['fa_runs_with_router_alarm'][1]}, moe runs with an attention alarm "
        f"{o['moe_runs_with_attention_alarm'][0]}/{o['moe_runs_with_attention_alarm'][1]}: met {_yes(o['met'])}"
    )
    return "\n".join(lines)


def _online_check(results: dict[str, Any]) -> str:
    """Offline == online: the replay with the session's default setting vs ``mechmon/alarm``."""
    runs = results["runs"]
    agree = [r for r in runs if r.get("online_first_alarm") == r.get("replay_first_alarm_default_setting")]
    return (
        f"Offline replay == online session (first `mechmon/alarm` vs the replay with the session's "
        f"default detector setting, which the runs used online): {len(agree)}/{len(runs)} runs agree."
    )


def _yes(flag: Optional[bool]) -> str:
    return "n/a" if flag is None else ("yes" if flag else "NO")


def _calibration_note(study: dict) -> str:
    seed = study.get("calibration_seed")
    return "" if seed is None else f", chosen on clean calibration seed {seed}"


def markdown_report(results: dict[str, Any]) -> str:
    study = results.get("study", {})
    det = study.get("detector", {})
    wall = study.get("wall_s")
    parts = [
        "## Fault study",
        "",
        f"preset `{study.get('preset')}`, {study.get('train_iters')} steps per run, seeds {study.get('seeds')}, "
        f"training wall time {'n/a' if wall is None else f'{wall:.0f} s'}; detector setting (one for all scenarios"
        f"{_calibration_note(study)}"
        f"): {det}",
        "",
        markdown_table(results),
        "",
        "`!` = alarm on a clean run or before the fault onset (false alarm); lead = divergence - alarm "
        "(share of divergence - onset).",
        "",
        _online_check(results),
        "",
        "### Orthogonality (runs alarmed at/after onset and before divergence / runs)",
        "",
        markdown_orthogonality(results),
        "",
        "### Targets",
        "",
        markdown_targets(results),
        "",
    ]
    return "\n".join(parts)


def write_results(results: dict[str, Any], out_dir: str) -> tuple[str, str]:
    """Write ``results.json`` and ``report.md``; returns their paths."""
    results["orthogonality"] = orthogonality(results)
    results["targets"] = evaluate_targets(results)
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(_clean_json(results), f, indent=2, sort_keys=False)
        f.write("\n")
    md_path = os.path.join(out_dir, "report.md")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(markdown_report(results))
    return json_path, md_path


def _clean_json(obj: Any) -> Any:
    """Non-finite floats -> None, so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean_json(v) for v in obj]
    return obj


def markdown_sensitivity(rows: list[dict[str, Any]]) -> str:
    """Table of :func:`~mechmon_megatron.research.study.study.sensitivity`: per setting, clean runs with a
    mechmon alarm, the fa runs' Δ2 alarm (lead share), fa runs with an attributable router
    alarm, the MoE runs' routing-entropy alarms, and MoE runs with an attention alarm."""
    lines = [
        "| false-alarm rate R (per 10^6 steps) | clean runs with a mechmon alarm | fa: Δ2 alarm (lead share) | "
        "fa: router alarm before div | moe-lr, moe-gbs (by seed): routing-entropy alarm | moe-*: attention alarm |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        st, runs = row["setting"], row["runs"]
        by = {sc: sorted((r for r in runs if r["scenario"] == sc), key=lambda r: r["seed"])
              for sc in ("clean", "fa", "moe-lr", "moe-gbs")}
        clean = sum(any(r["first_alarm"][f] is not None for f in MECHMON_FAMILIES) for r in by["clean"])
        fa = ", ".join(f"{_fmt_step(r['first_alarm']['attn_delta2'])} "
                       f"({_share(r['lead_to_divergence']['attn_delta2']['share'])})" for r in by["fa"])
        fa_router = sum(attributable_alarm(r, ROUTER_FAMILIES) for r in by["fa"])
        moe = by["moe-lr"] + by["moe-gbs"]
        entropy = ", ".join(_fmt_step(r["first_alarm"]["router_entropy"]) for r in moe)
        attention = sum(attributable_alarm(r, ATTN_FAMILIES) for r in moe)
        lines.append(f"| {st['false_alarm_rate']:g} | {clean}/{len(by['clean'])} | "
                     f"{fa} | {fa_router}/{len(by['fa'])} | {entropy} | {attention}/{len(moe)} |")
    return "\n".join(lines)


def _share(share: Optional[float]) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"
