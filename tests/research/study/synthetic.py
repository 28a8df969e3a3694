"""Synthetic run files for the fault-study tests (no training needed)."""

from __future__ import annotations

import json
import math
import os
import random
from typing import Optional


def metrics_rows(
    steps: int, seed: int = 0, diverge_at: Optional[int] = None, logit_growth_at: Optional[int] = None
) -> list[dict]:
    """Loss ~2 with noise; after ``diverge_at`` the loss climbs to ~4 (x2 of its minimum)."""
    rng = random.Random(seed)
    rows = []
    for t in range(1, steps + 1):
        loss = 2.0 + 3.0 * math.exp(-t / 30.0) + rng.gauss(0.0, 0.03)
        if diverge_at is not None and t >= diverge_at:
            loss += min(2.0, 0.05 * (t - diverge_at))
        logit = 10.0 + rng.gauss(0.0, 0.2)
        if logit_growth_at is not None and t >= logit_growth_at:
            logit *= 1.0 + 0.05 * (t - logit_growth_at)
        rows.append({"iteration": t, "lm_loss": loss, "grad_norm": 1.0 + rng.gauss(0.0, 0.05),
                     "lr": 1e-3, "step_time_s": 0.01, "max_attn_logit": logit})
    return rows


def check_rows(
    steps: int,
    interval: int = 10,
    seed: int = 0,
    layers: int = 2,
    heads: int = 2,
    attn_drop_at: Optional[int] = None,
    router_drop_at: Optional[int] = None,
    collapse_at: Optional[int] = None,
) -> list[dict]:
    """Per-check mechmon scalars: flat noisy streams; optional drops of layer 1's signals."""
    rng = random.Random(seed + 1)
    rows = []
    for t in range(interval, steps + 1, interval):
        scalars = {}
        for layer in range(1, layers + 1):
            attn_factor = 0.5 if (attn_drop_at is not None and t >= attn_drop_at and layer == 1) else 1.0
            router_factor = 0.5 if (router_drop_at is not None and t >= router_drop_at and layer == 1) else 1.0
            for head in range(heads):
                scalars[f"mechmon/attn/delta2_entropy/layer_{layer}/head_{head}"] = 2.0 * attn_factor + rng.gauss(
                    0, 0.01
                )
            scalars[f"mechmon/attn/delta2_entropy/layer_{layer}"] = 2.0 * attn_factor
            scalars[f"mechmon/attn/dw_entropy/layer_{layer}"] = 3.0 + rng.gauss(0, 0.01)
            scalars[f"mechmon/attn/dwk_entropy/layer_{layer}"] = 3.0 + rng.gauss(0, 0.01)
            scalars[f"mechmon/attn/wq_spectral_norm/layer_{layer}"] = 1.0 / attn_factor**2 + rng.gauss(0, 0.01)
            scalars[f"mechmon/router/token_entropy/layer_{layer}"] = 2.0 * router_factor + rng.gauss(0, 0.01)
            scalars[f"mechmon/router/weight_similarity/layer_{layer}"] = 0.01 + rng.gauss(0, 0.002)
            collapsed = collapse_at is not None and t >= collapse_at and layer == 1
            scalars[f"mechmon/router/max_vio/layer_{layer}"] = 2.5 if collapsed else 0.5
        scalars["mechmon/alarm"] = 0.0
        rows.append({"step": t, "scalars": scalars})
    return rows


def write_run(directory: str, metrics: list[dict], checks: list[dict]) -> tuple[str, str]:
    os.makedirs(os.path.join(directory, "mechmon"), exist_ok=True)
    mpath = os.path.join(directory, "metrics.jsonl")
    cpath = os.path.join(directory, "mechmon", "mechmon_scalars.jsonl")
    with open(mpath, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in metrics)
    with open(cpath, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in checks)
    return mpath, cpath


def detector_checks(steps: int, seed: int, interval: int = 20) -> list[dict]:
    """Per-check detector streams of a 2-layer, 2-head toy recorded with ``--mechmon-short-window``:
    Δ2 entropy per head (long and short window), dW / dW_k, routing entropy and router similarity
    per layer, all stationary."""
    rng = random.Random(seed)
    rows = []
    for t in range(interval, steps + 1, interval):
        sc: dict[str, float] = {}
        for layer in (1, 2):
            for head in range(2):
                sc[f"mechmon/attn/delta2_entropy/layer_{layer}/head_{head}"] = 2.0 + rng.gauss(0, 0.02)
                sc[f"mechmon/attn/delta2_entropy_short/layer_{layer}/head_{head}"] = 1.5 + rng.gauss(0, 0.03)
            sc[f"mechmon/attn/dw_entropy/layer_{layer}"] = 3.0 + rng.gauss(0, 0.02)
            sc[f"mechmon/attn/dwk_entropy/layer_{layer}"] = 3.0 + rng.gauss(0, 0.02)
            sc[f"mechmon/router/token_entropy/layer_{layer}"] = 2.0 + rng.gauss(0, 0.02)
            sc[f"mechmon/router/weight_similarity/layer_{layer}"] = 0.01 + rng.gauss(0, 0.002)
        rows.append({"step": t, "scalars": sc})
    return rows
