"""Plots of the detector study: delay versus false-alarm rate per fault, and the null tails."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from mechmon_megatron.detect.null_model import TailTable
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.study.detector_markdown import RULE_ORDER
from mechmon_megatron.research.study.pooled_replay import null_statistics


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def plot_delay_vs_far(results: Mapping[str, Any], out_dir: str, rules: Sequence[str] = RULE_ORDER,
                      prefix: str = "delay_vs_far") -> list[str]:
    """One PNG per fault group (``OUT/<prefix>_<group>.png``): median detection delay (steps after
    onset; misses at the run's end) against the healthy false-alarm rate, one curve per rule of
    ``rules`` over its threshold sweep."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    runs = results["runs"]
    resolution = 1e6 / max(1, results["healthy_steps"])
    groups: dict[str, list[str]] = {}
    for run_id, r in runs.items():
        if r["kind"] != "healthy":
            groups.setdefault(r["group"], []).append(run_id)
    paths = []
    for group, members in sorted(groups.items()):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        cap = max(runs[m]["steps"] - (runs[m]["onset"] or 0) for m in members)
        for rule in rules:
            sweep = results["sweeps"].get(rule)
            if sweep is None:
                continue
            pts = []
            for episodes, firsts in zip(sweep["healthy_episodes"], sweep["first_alarm"]):
                far = 1e6 * episodes / results["healthy_steps"]
                delays = [cap if firsts.get(m) is None else firsts[m] - (runs[m]["onset"] or 0) for m in members]
                pts.append((max(far, resolution / 2), statistics.median(delays)))
            pts.sort()
            style = "-o" if rule.startswith("mechmon") else "--s"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                ms=3,
                lw=1.2,
                label=rule.replace("mechmon ", "mechmon "),
            )
        ax.set_xscale("log")
        ax.axvline(resolution, color="0.6", lw=0.8, ls=":")
        ax.text(resolution, cap * 1.02, " one healthy alarm", fontsize=7, color="0.4")
        ax.set_xlabel("false alarms per 10^6 healthy steps (points left of the dotted line: none observed)")
        ax.set_ylabel("median detection delay (steps after onset)")
        ax.set_ylim(0, cap * 1.1)
        ax.set_title(f"{group}: delay vs false-alarm rate ({len(members)} runs; misses plotted at {cap})", fontsize=9)
        ax.legend(fontsize=6.5, ncol=2, loc="best")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{prefix}_{_slug(group)}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_null_tails(
    records: Mapping[str, Any], table: TailTable, calibration: Sequence[str], out_dir: str, interval: int = 20
) -> str:
    """Empirical survival P(S > h) of the layer-level CUSUM on calibration and held-out healthy
    runs against the fitted exponential tail, per family (native overlap)."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    overlap = max(table.tails)
    healthy = {k: r for k, r in records.items() if r.healthy}
    config = default_sequential_config(interval)
    calib = null_statistics([healthy[k].data.checks for k in calibration if k in healthy], config)
    held = null_statistics([r.data.checks for k, r in healthy.items() if k not in calibration], config)
    families = sorted(table.tails[overlap])
    fig, axes = plt.subplots(1, len(families), figsize=(3.4 * len(families), 3.2), squeeze=False)
    for ax, family in zip(axes[0], families):
        for label, stats, style in (("calibration", calib, "-"), ("held out", held, "--")):
            values = sorted(stats[family]["layer"])
            if not values:
                continue
            n = len(values)
            xs = values
            ys = [(n - i - 1) / n for i in range(n)]
            ax.step(xs, [max(y, 0.5 / n) for y in ys], style, where="post", label=f"{label} (n={n})")
        tail = table.tails[overlap][family]["layer"]
        hs = [tail.u0 + i * 0.25 for i in range(200)]
        ax.plot(hs, [math.exp(tail.log_survival(h)) for h in hs], ":", color="k", label="fitted (theta lower bound)")
        ax.set_yscale("log")
        ax.set_ylim(1e-5, 1.2)
        ax.set_xlim(0, max(4 * (tail.u0 + 1 / tail.theta), 1))
        ax.set_title(family, fontsize=9)
        ax.set_xlabel("layer CUSUM S")
    axes[0][0].set_ylabel("P(S > h) per check")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    path = os.path.join(out_dir, "null_tails.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
