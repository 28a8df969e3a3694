"""One picture of the recovery study: per cell, the loss each operator kept against the clean run,
with what mechmon's loop threw away (docs/RECOVERY.md).

Reads the records' curves (``loss_curve`` of each operator, ``discarded_loss_curves``,
``clean_loss_curve``: 20-step block means, ``campaign.loss_curve``); cells recorded before the
curves existed are left out and named in the return value.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Optional

COLOURS = {"clean": "0.55", "none": "tab:red", "practice": "tab:orange", "mechmon": "tab:blue"}


def _xy(curve: Sequence[Sequence[Optional[float]]]) -> tuple[list[float], list[float]]:
    return [float(p[0]) for p in curve], [math.nan if p[1] is None else float(p[1]) for p in curve]


def _relaunches(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in body.get("recovery", []) if r.get("action") == "relaunch"]


def _practice_is_none(record: dict[str, Any]) -> bool:
    """Today's practice did nothing (no restart) and so kept the very trajectory of ``none``."""
    none, practice = record["operators"].get("none", {}), record["operators"].get("practice", {})
    return practice.get("restarts") == 0 and practice.get("loss_curve") == none.get("loss_curve")


def _title(record: dict[str, Any]) -> str:
    mech = record["operators"].get("mechmon", {})
    gap = mech.get("loss_vs_clean")
    tail = "mechmon not run" if mech.get("status") != "done" else (
        f"mechmon: {mech['restarts']} restart{'s' if mech['restarts'] != 1 else ''}, "
        + ("loss diverged" if gap is None else f"{100 * gap:+.1f} % vs clean"))
    return f"{record['cell']}\n{tail}"


def plottable(record: dict[str, Any]) -> bool:
    """The record has the clean curve and at least one finished operator's curve."""
    return bool(record.get("clean_loss_curve")) and any(
        b.get("loss_curve") for b in record.get("operators", {}).values())


def plot_recovery(records: Sequence[dict[str, Any]], path: str, columns: int = 2) -> list[str]:
    """Write one PNG with a panel per plottable record (in the given order); returns the cells
    left out (no curves). The y range is the clean run's range widened by half, so a diverged
    operator leaves the panel at the top instead of flattening the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in records if plottable(r)]
    left_out = [r.get("cell", "?") for r in records if not plottable(r)]
    if not shown:
        raise ValueError("no record has loss curves (recorded before they existed: rerun "
                         "`tools/recovery_study.py record` on the run folders)")
    rows = -(-len(shown) // columns)
    fig, axes = plt.subplots(rows, min(columns, len(shown)), figsize=(4.6 * min(columns, len(shown)), 3.4 * rows),
                             squeeze=False)
    for ax, record in zip(axes.flat, shown):
        cx, cy = _xy(record["clean_loss_curve"])
        ax.plot(cx, cy, color=COLOURS["clean"], lw=2.2, label="clean run")
        same = _practice_is_none(record)
        for op in ("none", "practice", "mechmon"):
            body = record["operators"].get(op, {})
            if not body.get("loss_curve") or (op == "practice" and same):
                continue
            x, y = _xy(body["loss_curve"])
            label = "none = practice (no spike rule fired)" if op == "none" and same else f"{op} (kept)"
            ax.plot(x, y, color=COLOURS[op], lw=1.2, label=label)
            for k, curve in enumerate(body.get("discarded_loss_curves", [])):
                dx, dy = _xy(curve)
                ax.plot(dx, dy, color=COLOURS[op], lw=0.9, ls=":",
                        label=f"{op} (discarded)" if k == 0 else None)
        onset = record.get("onset")
        if record.get("scenario") == "fa" and onset:
            ax.axvline(onset, color="k", ls="--", lw=0.8, label="fault onset")
        for k, r in enumerate(_relaunches(record["operators"].get("mechmon", {}))):
            alert, ckpt = r.get("alert") or {}, r.get("checkpoint") or {}
            if alert.get("iteration") is not None:
                ax.axvline(alert["iteration"], color=COLOURS["mechmon"], ls="--", lw=0.8,
                           label="mechmon alarm" if k == 0 else None)
            if ckpt.get("iteration") is not None:
                ax.axvline(ckpt["iteration"], color=COLOURS["mechmon"], ls="-.", lw=0.8,
                           label="rolled back to" if k == 0 else None)
        finite = [v for v in cy if math.isfinite(v)]
        if finite:
            lo, hi = min(finite), max(finite)
            ax.set_ylim(lo - 0.1 * (hi - lo), hi + 0.5 * (hi - lo))
        ax.set_title(_title(record), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("LM loss (20-step mean)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06 if rows > 1 else 0.12, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return left_out
