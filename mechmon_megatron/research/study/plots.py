"""PNG plots of one fault-study run: loss and every monitor against the step, with markers.

One figure per run (``OUT/plots/<run_id>.png``), panels sharing the step axis:

1. loss (log scale), 2. grad norm and max attention logit (log scale), 3. Delta2 spectral
entropy (mean over heads, per layer), 4. full-matrix dW_q entropy per layer, 5. W_q spectral norm
per layer, 6. router token entropy per layer, 7. router weight similarity per layer,
8. router MaxVio per layer.

Vertical lines: fault onset (grey, dotted), loss divergence (black, solid), expert collapse
(brown, dash-dot), and the first alarm of each family in the panel of its signal (red, dashed).
Matplotlib runs with the non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

from mechmon_megatron.research.study.analysis import RunData

_PANELS: tuple[tuple[str, str, Optional[str]], ...] = (
    # (scalar metric under mechmon/<family>/<metric>/layer_L, y label, first_alarm key marked)
    ("attn/delta2_entropy", "Δ2 entropy (nats)", "attn_delta2"),
    ("attn/dw_entropy", "dW_q entropy (nats)", "attn_dw"),
    ("attn/wq_spectral_norm", "W_q σmax", "wq_spectral_norm"),
    ("router/token_entropy", "routing entropy (nats)", "router_entropy"),
    ("router/weight_similarity", "router weight sim.", "router_weights"),
    ("router/max_vio", "MaxVio", None),
)


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # matplotlib is in the `test` extra
        raise ImportError("fault-study plots need matplotlib: pip install 'mechmon-megatron[test]'") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _layer_series(data: RunData, metric: str) -> dict[int, tuple[list[int], list[float]]]:
    prefix = f"mechmon/{metric}/layer_"
    out = {}
    for name in data.scalar_names():
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            out[int(name[len(prefix):])] = data.series(name)
    return dict(sorted(out.items()))


def _mark(ax, step: Optional[int], color: str, style: str, label: Optional[str]) -> None:
    if step is not None:
        ax.axvline(step, color=color, linestyle=style, linewidth=1.2, label=label)


def _events(ax, run: dict[str, Any], label: bool) -> None:
    _mark(ax, run.get("fault_onset"), "grey", ":", "fault onset" if label else None)
    _mark(ax, run.get("divergence_step"), "black", "-", "loss divergence" if label else None)
    _mark(ax, run.get("expert_collapse_step"), "saddlebrown", "-.", "expert collapse" if label else None)


def _legend(ax, ncol: int = 1) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=6, ncol=ncol)


def _finite(xs: list[int], ys: list[float]) -> tuple[list[int], list[float]]:
    pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(data: RunData, run: dict[str, Any], path: str) -> str:
    """Draw one run's figure to ``path`` (PNG); returns the path."""
    plt = _pyplot()
    panels = [p for p in _PANELS if _layer_series(data, p[0])]
    fig, axes = plt.subplots(2 + len(panels), 1, figsize=(9, 2.0 * (2 + len(panels))), sharex=True)
    first = run.get("first_alarm", {})
    title = f"{run.get('scenario')} seed {run.get('seed')}"
    axes[0].set_title(title)

    ax = axes[0]
    x, y = _finite(data.steps, data.loss)
    ax.plot(x, y, linewidth=0.6, color="tab:blue")
    if y and min(y) > 0:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    _events(ax, run, label=True)
    for key, color in (("loss_6sigma", "tab:orange"), ("loss_2x_mean", "tab:purple"), ("loss_10x", "tab:pink")):
        _mark(ax, first.get(key), color, "--", f"{key} alarm")
    _legend(ax)

    ax = axes[1]
    x, y = _finite(data.steps, data.grad_norm)
    ax.plot(x, y, linewidth=0.6, color="tab:green", label="grad norm")
    x, y = _finite(data.steps, data.max_attn_logit)
    if y:
        ax.plot(x, y, linewidth=0.6, color="tab:red", label="max attn logit")
    ax.set_yscale("log")
    ax.set_ylabel("gnorm / logit")
    _events(ax, run, label=False)
    _mark(ax, first.get("grad_norm_6sigma"), "tab:green", "--", "gnorm 6σ alarm")
    _mark(ax, first.get("max_attn_logit"), "tab:red", "--", "max-logit alarm")
    _legend(ax)

    for ax, (metric, ylabel, key) in zip(axes[2:], panels):
        for layer, (xs, ys) in _layer_series(data, metric).items():
            xs, ys = _finite(xs, ys)
            ax.plot(xs, ys, linewidth=0.8, label=f"layer {layer}")
        ax.set_ylabel(ylabel, fontsize=8)
        _events(ax, run, label=False)
        if key is not None:
            _mark(ax, first.get(key), "red", "--", f"{key} alarm")
        _legend(ax, ncol=2)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_effective_experts(
    panels: dict[str, list[tuple[str, RunData, dict[str, Any]]]], floor: Optional[float], path: str
) -> str:
    """Routing collapse at a glance: one panel per key of ``panels`` (e.g. a seed), one line per
    run (label, data, analysed run) = the lowest MoE layer's effective experts per token,
    exp(mean routing entropy), per check. Dashed line: the floor (effective experts); ``x``:
    the run's first routing-entropy alarm; ``o``: its expert collapse. Returns ``path``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), sharey=True, squeeze=False)
    for ax, (title, runs) in zip(axes[0], panels.items()):
        for label, data, run in runs:
            lowest: dict[int, float] = {}
            for series_steps, values in _layer_series(data, "router/effective_experts").values():
                for s, v in zip(series_steps, values):
                    if math.isfinite(v):
                        lowest[s] = min(v, lowest.get(s, math.inf))
            steps = sorted(lowest)
            (line,) = ax.plot(steps, [lowest[s] for s in steps], linewidth=1.2, label=label)
            for key, marker in (("router_entropy_alarm", "x"), ("expert_collapse_step", "o")):
                step = run.get(key)
                if step in lowest:
                    ax.plot([step], [lowest[step]], marker=marker, color=line.get_color(), markersize=8,
                            markerfacecolor="none" if marker == "o" else None)
        if floor is not None:
            ax.axhline(floor, color="red", linestyle="--", linewidth=1, label=f"floor ({floor:g})")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        _legend(ax)
    axes[0][0].set_ylabel("effective experts / token (lowest layer)")
    fig.suptitle("x = routing-entropy alarm, o = expert collapse (MaxVio >= 2 at 5 checks)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
