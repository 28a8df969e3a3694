"""The HTML report: one sentence on top, the series' facts, and one PNG per layer.

Each layer's figure has one panel per monitor family, x = checkpoint iteration (the later
checkpoint of each pair): the Delta2 spectral entropy of every head (thin) and their mean
(thick), the whole-layer dW_q / dW_k entropies, the router weight similarity S and eps for MoE
layers, and the detector's per-layer CUSUM of each family with its alarm threshold (dashed).
The first anomaly is shaded from ``after_iteration`` to ``before_iteration`` on every panel.
"""

from __future__ import annotations

import html
import math
import os
import re
from collections.abc import Sequence
from typing import Any, Optional

from mechmon_megatron.detect.families import FAMILIES
from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.replay import Anomaly, CheckValues
from mechmon_megatron.session import names

__all__ = ["write_report"]

_HEAD = re.compile(r"^mechmon/attn/delta2_entropy/layer_(\d+)/head_(\d+)$")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ScanInputError(
            "the HTML report's plots need matplotlib: pip install 'mechmon-megatron[scan]'"
        ) from exc
    return plt


def _series(checks: Sequence[CheckValues], name: str) -> tuple[list[int], list[float]]:
    """The scalar over the checks; a check without it (detector warm-up after a restart) breaks the line."""
    xs, ys = [], []
    for c in checks:
        xs.append(c.step)
        ys.append(c.scalars.get(name, math.nan))
    return xs, ys


def _mark(ax: Any, first: Optional[Anomaly]) -> None:
    if first is not None:
        ax.axvspan(first.after_iteration, first.before_iteration, color="tab:red", alpha=0.15, lw=0)
        ax.axvline(first.before_iteration, color="tab:red", lw=1.2)


def _layer_figure(path: str, layer: int, checks: Sequence[CheckValues], first: Optional[Anomaly],
                  thresholds: dict[str, Any], has_router: bool) -> None:
    plt = _pyplot()
    panels = 4 if has_router else 3
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.3 * panels), sharex=True)
    heads = sorted({int(m.group(2)) for c in checks for n in c.scalars if (m := _HEAD.match(n)) and
                    int(m.group(1)) == layer})
    ax = axes[0]
    for h in heads:
        ax.plot(*_series(checks, names.attn("delta2_entropy", layer, h)), lw=0.7, alpha=0.6)
    ax.plot(*_series(checks, names.attn("delta2_entropy", layer)), color="black", lw=2, label="mean over heads")
    ax.set_ylabel("Δ2 entropy (nats)")
    ax.set_title(f"layer {layer}: attn_delta2 (one thin line per head)", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax = axes[1]
    ax.plot(*_series(checks, names.attn("dw_entropy", layer)), label="dW_q", marker=".")
    ax.plot(*_series(checks, names.attn("dwk_entropy", layer)), label="dW_k", marker=".")
    ax.set_ylabel("dW entropy (nats)")
    ax.set_title("attn_dw: whole-layer dW_q / dW_k spectral entropy", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    if has_router:
        ax = axes[2]
        ax.plot(*_series(checks, names.router("weight_similarity", layer)), label="S", color="tab:purple", marker=".")
        ax.set_ylabel("similarity S")
        twin = ax.twinx()
        twin.plot(*_series(checks, names.router("eps", layer)), label="eps", color="tab:gray", ls=":")
        twin.set_ylabel("eps")
        ax.set_title("router_weights: mean pairwise cosine S (detector) and conditioning ratio eps", fontsize=9)
    ax = axes[-1]
    for family in (spec.name for spec in FAMILIES if spec.from_checkpoints):  # what a scan feeds
        xs, ys = _series(checks, f"{names.DETECT_PREFIX}/{family}/cusum/layer_{layer}")
        if all(math.isnan(y) for y in ys):
            continue
        line = ax.plot(xs, ys, label=f"{family} layer {layer}", marker=".")[0]
        levels = thresholds.get(family, {})
        if "layer" in levels:
            ax.axhline(levels["layer"]["alarm"], color=line.get_color(), ls="--", lw=0.8)
        fx, fy = _series(checks, f"{names.DETECT_PREFIX}/{family}/cusum")
        if not all(math.isnan(y) for y in fy):
            ax.plot(fx, fy, color=line.get_color(), ls=":", lw=1.2, label=f"{family} family (all layers)")
            if "family" in levels:
                ax.axhline(levels["family"]["alarm"], color=line.get_color(), ls="-.", lw=0.6)
    ax.set_ylabel("CUSUM S")
    ax.set_title("detector CUSUMs (dashed / dash-dot: layer / family alarm threshold; gaps: warm-up)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("checkpoint iteration")
    for ax in axes:
        _mark(ax, first)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _heads(heads: Sequence[int]) -> str:
    return f", heads {', '.join(str(h) for h in heads)}" if heads else ""


def write_report(stage: str, summary: dict[str, Any], checks: Sequence[CheckValues], layers: Sequence[int],
                 router_layers: Sequence[int], first: Optional[Anomaly]) -> list[str]:
    """Write ``report.html`` and ``img/layer_L.png`` under ``stage``; returns the entries written."""
    img = os.path.join(stage, "img")
    os.makedirs(img, exist_ok=True)
    thresholds = summary["detector"]["thresholds"]
    for layer in layers:
        _layer_figure(os.path.join(img, f"layer_{layer}.png"), layer, checks, first, thresholds,
                      layer in router_layers)
    esc = html.escape
    facts = [
        ("checkpoints", f"{len(summary['checkpoints'])} ({summary['format']}), iterations "
                        f"{summary['checkpoints'][0]} ... {summary['checkpoints'][-1]}"),
        ("pairs judged", f"{summary['pairs']} (window {summary['window_steps']} steps, a check every "
                         f"{summary['interval_steps']} steps)"),
        ("layers", ", ".join(str(L) for L in layers)),
        ("detector", f"{summary['detector']['tests']} tests, {summary['false_alarm_rate']:g} false alarms per "
                     f"10^6 steps; warm-up {summary['detector']['design']['warmup_checks']} checks"),
    ]
    rows = "\n".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts)
    anomalies = "\n".join(
        f"<li>({a['after_iteration']}, {a['before_iteration']}]: {esc(a['family'])} {esc(a['level'])} test, "
        f"layers {', '.join(str(L) for L in a['layers'])}{_heads(a['heads'])}: {esc(a['reason'])}</li>"
        for a in summary["anomalies"]
    ) or "<li>none</li>"
    notes = "".join(f"<li>{esc(n)}</li>" for n in summary["notes"])
    figures = "\n".join(
        f'<figure><img src="img/layer_{L}.png" alt="layer {L}"><figcaption>layer {L}</figcaption></figure>'
        for L in layers
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mechmon-scan report</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; max-width: 70em; }}
h1 {{ font-size: 1.5em; }} .verdict {{ font-size: 1.25em; padding: .6em; border-radius: .3em; }}
.bad {{ background: #fde2e1; }} .ok {{ background: #e2f5e4; }}
table {{ border-collapse: collapse; }} th, td {{ text-align: left; padding: .2em .8em; border-bottom: 1px solid #ddd; }}
figure {{ display: inline-block; margin: .5em; }} figcaption {{ text-align: center; }}
</style></head><body>
<p class="verdict {'bad' if first else 'ok'}">{esc(summary['sentence'])}</p>
<h1>mechmon-scan</h1>
<table>{rows}</table>
<h2>Alarms</h2><ul>{anomalies}</ul>
{f'<h2>Notes</h2><ul>{notes}</ul>' if notes else ''}
<h2>Monitors per layer</h2>
<p>x: checkpoint iteration (the later checkpoint of each pair). Shaded: the first anomaly's interval.
Routing-entropy monitors need tokens and are not computed from checkpoints.</p>
{figures}
</body></html>
"""
    with open(os.path.join(stage, "report.html"), "w", encoding="utf-8") as f:
        f.write(page)
    return ["img", "report.html"]
