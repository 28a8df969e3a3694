"""One attention layer's check: Delta spectra per head, dW spectra, full-matrix dW on the owner.

Input: the snapshot taken ``delta`` steps ago and the weights now (``QKWeights`` / ``FullQK``).
Output: scalars for the writer and detector streams (one per head for Delta2, one per layer for
the full-matrix dW). Pure torch, no host imports.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import Tensor

from mechmon_megatron.detect.families import ATTN_DELTA2, ATTN_DELTA2_SHORT, ATTN_DW
from mechmon_megatron.monitors.leading_direction import delta2_spectrum_and_directions, direction_persistence
from mechmon_megatron.monitors.norm_fold import NormFold, fold_norm
from mechmon_megatron.monitors.qk_increment import qk_increment_singular_values
from mechmon_megatron.monitors.spectral import spectral_stats
from mechmon_megatron.monitors.update_spectrum import (
    per_head_update_singular_values,
    spectral_norm,
    update_singular_values,
)
from mechmon_megatron.session import names
from mechmon_megatron.session.host import FullQK, QKWeights
from mechmon_megatron.session.records import CheckOutput, NonFinite, Partial, Stream


def _finite(*tensors: torch.Tensor) -> bool:
    """All finite, read back in one host sync (the kernels below then skip their own checks)."""
    return bool(torch.stack([torch.isfinite(t).all().to(tensors[0].device) for t in tensors]).all())


def _gammas(prev: QKWeights, now: QKWeights) -> list[Tensor]:
    return [n.gamma for w in (prev, now) for n in (w.q_norm, w.k_norm) if n is not None and n.gamma is not None]


def _effective(prev: QKWeights, now: QKWeights) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(wq_prev, wk_prev, wq_now, wk_now)`` with each QK-norm folded in (float64 where one is),
    on ``now``'s device."""
    device = now.wq.device
    return (fold_norm(prev.wq.to(device), _on(prev.q_norm, device)),
            fold_norm(prev.wk.to(device), _on(prev.k_norm, device)),
            fold_norm(now.wq, now.q_norm), fold_norm(now.wk, now.k_norm))


def _on(norm: Optional[NormFold], device: torch.device) -> Optional[NormFold]:
    if norm is None or norm.gamma is None:
        return norm
    return NormFold(gamma=norm.gamma.to(device), centres=norm.centres)


def check_heads(
    layer_number: int,
    prev: QKWeights,
    now: QKWeights,
    alpha: float,
    method: Literal["gram", "compressed"],
    per_head_scalars: bool,
) -> CheckOutput:
    """Delta1/2/3 and per-head dW spectra for the heads one rank reports.

    With a QK-norm the Delta spectra are those of the effective rows ``diag(gamma) P W``
    (``monitors/norm_fold.py``); the per-head dW spectra stay those of the projection's own update.
    """
    wq_prev, wk_prev = prev.wq.to(now.wq.device), prev.wk.to(now.wk.device)
    if not _finite(now.wq, now.wk, wq_prev, wk_prev, *_gammas(prev, now)):
        return CheckOutput(nonfinite=[NonFinite(layer_number, f"layer {layer_number}: non-finite Q/K weights")])
    spectra = qk_increment_singular_values(*_effective(prev, now), method=method, assume_finite=True)
    # Singular values from the kernels are non-negative by construction (trusted: no sign check).
    stats = {key: spectral_stats(values, alpha=alpha, trusted=True) for key, values in spectra.items()}
    dwq = spectral_stats(per_head_update_singular_values(wq_prev, now.wq, assume_finite=True), alpha, trusted=True)
    dwk = spectral_stats(per_head_update_singular_values(wk_prev, now.wk, assume_finite=True), alpha, trusted=True)

    d2 = stats["delta2"]
    heads = [now.head_offset + i for i in range(now.wq.shape[0])]
    n_heads, n_groups = float(len(heads)), float(now.wk.shape[0])
    ratio = stats["delta3"]["fro_norm"] / d2["fro_norm"].clamp_min(torch.finfo(torch.float64).tiny)
    # Everything the host needs, read back in one transfer (one host sync on an accelerator).
    sums = torch.stack([d2["entropy"].sum(), d2["entropy"].min(), d2["normalized_entropy"].sum(),
                        d2["effective_rank"].sum(), stats["delta1"]["entropy"].sum(),
                        stats["delta3"]["entropy"].sum(), ratio.sum(), dwq["entropy"].sum(), dwk["entropy"].sum()])
    values = torch.cat([sums.to(torch.float64), d2["entropy"].to(torch.float64), d2["valid"].to(torch.float64),
                        d2["fro_norm"].to(torch.float64)]).tolist()
    (h_sum, h_min, norm_sum, rank_sum, d1_sum, d3_sum, ratio_sum, dwq_sum, dwk_sum), per_head = values[:9], values[9:]
    n = len(heads)
    entropy, valid, fro = per_head[:n], per_head[n : 2 * n], per_head[2 * n :]
    # Partials, merged on the writer over the TP ranks that share a layer (see merge_partials).
    scalars: dict[str, Partial] = {
        names.attn("delta2_entropy", layer_number): Partial("mean", h_sum, n_heads),
        names.attn("delta2_entropy_min", layer_number): Partial("min", h_min),
        names.attn("delta2_norm_entropy", layer_number): Partial("mean", norm_sum, n_heads),
        names.attn("delta2_eff_rank", layer_number): Partial("mean", rank_sum, n_heads),
        names.attn("delta1_entropy", layer_number): Partial("mean", d1_sum, n_heads),
        names.attn("delta3_entropy", layer_number): Partial("mean", d3_sum, n_heads),
        names.attn("delta3_to_delta2", layer_number): Partial("mean", ratio_sum, n_heads),
        names.attn("dwq_head_entropy", layer_number): Partial("mean", dwq_sum, n_heads),
        # With fewer query groups than TP ranks a group is replicated on tp/ng ranks; every group
        # is replicated equally often, so sum/count is still the exact mean over groups.
        names.attn("dwk_head_entropy", layer_number): Partial("mean", dwk_sum, n_groups),
    }
    streams: list[Stream] = []
    for i, head in enumerate(heads):
        value = entropy[i] if valid[i] else float("nan")
        if not valid[i] and fro[i] == 0.0:
            continue  # no update in the window (e.g. frozen layer): nothing to judge
        streams.append(Stream(name=names.attn("delta2_entropy", layer_number, head), family=ATTN_DELTA2.name,
                              value=value, layer_number=layer_number, member=f"head_{head}", head=head))
        if per_head_scalars:
            scalars[names.attn("delta2_entropy", layer_number, head)] = Partial("value", value)
    return CheckOutput(scalars=scalars, streams=streams)


Directions = tuple[Tensor, Tensor]
"""Leading left / right singular vectors of each head's short-window Delta2 (``[heads, hidden]``)."""


def check_heads_short(
    layer_number: int,
    prev: QKWeights,
    now: QKWeights,
    alpha: float,
    method: Literal["gram", "compressed"],
    per_head_scalars: bool,
    previous: Optional[Directions] = None,
) -> tuple[CheckOutput, Optional[Directions]]:
    """Delta2 entropy per head over the short window (``prev`` is the snapshot one interval old),
    and the persistence of its leading direction against the previous short window's.

    Scalars ``mechmon/attn/delta2_entropy_short/layer_L`` (mean over heads, nats) and, with
    ``per_head_scalars``, ``.../layer_L/head_H``; one ``attn_delta2_short`` stream per head. With
    ``previous`` (the directions of the window just before this one):
    ``mechmon/attn/delta2_short_persistence/layer_L`` (mean over heads, in [0, 1]; per head with
    ``per_head_scalars``), recorded only (no detector family). Returns the output and this
    window's directions (None when the weights are non-finite: the long check reports those).
    """
    wq_prev, wk_prev = prev.wq.to(now.wq.device), prev.wk.to(now.wk.device)
    if not _finite(now.wq, now.wk, wq_prev, wk_prev, *_gammas(prev, now)):
        return CheckOutput(), None
    s, u, v = delta2_spectrum_and_directions(*_effective(prev, now), method=method, assume_finite=True)
    d2 = spectral_stats(s, alpha=alpha, trusted=True)
    directions = (u, v)
    heads = [now.head_offset + i for i in range(now.wq.shape[0])]
    n = len(heads)
    parts = [d2["entropy"].to(torch.float64), d2["valid"].to(torch.float64), d2["fro_norm"].to(torch.float64)]
    if previous is not None:
        parts.append(direction_persistence(previous[0], previous[1], directions[0], directions[1]))
    values = torch.cat(parts).tolist()  # one host sync
    entropy, valid, fro = values[:n], values[n : 2 * n], values[2 * n : 3 * n]
    persistence = values[3 * n :]
    scalars: dict[str, Partial] = {
        names.attn("delta2_entropy_short", layer_number): Partial("mean", float(sum(entropy)), float(n)),
    }
    streams: list[Stream] = []
    moved = [i for i in range(n) if valid[i] or fro[i] != 0.0]  # a window without update: nothing to judge
    for i in moved:
        value = entropy[i] if valid[i] else float("nan")
        head = heads[i]
        streams.append(Stream(name=names.attn("delta2_entropy_short", layer_number, head),
                              family=ATTN_DELTA2_SHORT.name, value=value, layer_number=layer_number,
                              member=f"head_{head}", head=head))
        if per_head_scalars:
            scalars[names.attn("delta2_entropy_short", layer_number, head)] = Partial("value", value)
    if persistence and moved:
        kept = [persistence[i] for i in moved if valid[i]]
        if kept:
            scalars[names.attn("delta2_short_persistence", layer_number)] = Partial("mean", float(sum(kept)),
                                                                                  float(len(kept)))
        if per_head_scalars:
            for i in moved:
                if valid[i]:
                    scalars[names.attn("delta2_short_persistence", layer_number, heads[i])] = Partial(
                        "value", persistence[i])
    return CheckOutput(scalars=scalars, streams=streams), directions


def check_full(
    layer_number: int,
    prev: FullQK,
    now: FullQK,
    alpha: float,
    method: Literal["randomized", "exact"] = "randomized",
    rank: int = 128,
    norm_iters: int = 16,
) -> CheckOutput:
    """Full-matrix dW_q / dW_k spectra of one layer, on its owning rank.

    ``method="randomized"`` keeps the top ``rank`` singular values (certified lower bounds, see
    ``update_singular_values``; the whole spectrum up to round-off when ``rank >= min(m, n)``);
    ``"exact"`` the whole fp64 spectrum. ``||W_q||_2`` by ``norm_iters`` power iterations (0: SVD).
    """
    wq_prev, wk_prev = prev.wq.to(now.wq.device), prev.wk.to(now.wk.device)
    if not _finite(now.wq, now.wk, wq_prev, wk_prev):
        return CheckOutput(nonfinite=[NonFinite(layer_number, f"layer {layer_number}: non-finite Q/K weights")])
    kwargs = {"method": "randomized", "rank": rank} if method == "randomized" else {"method": "exact"}
    dq = update_singular_values(wq_prev, now.wq, assume_finite=True, **kwargs)
    dk = update_singular_values(wk_prev, now.wk, assume_finite=True, **kwargs)
    sq = spectral_stats(dq["singular_values"], alpha=alpha, trusted=True)
    sk = spectral_stats(dk["singular_values"], alpha=alpha, trusted=True)
    wq_norm = spectral_norm(now.wq, power_iters=norm_iters)
    # One transfer to the host for the whole layer.
    hq, hk, stable, fro, norm, valid_q, valid_k = torch.stack([
        sq["entropy"], sk["entropy"], sq["stable_rank"], dq["fro_norm"], wq_norm,
        sq["valid"].to(torch.float64), sk["valid"].to(torch.float64)]).tolist()
    scalars: dict[str, Partial] = {
        names.attn("dw_entropy", layer_number): Partial("value", hq),
        names.attn("dwk_entropy", layer_number): Partial("value", hk),
        names.attn("dw_stable_rank", layer_number): Partial("value", stable),
        names.attn("dw_fro_norm", layer_number): Partial("value", fro),
        names.attn("wq_spectral_norm", layer_number): Partial("value", norm),
    }
    streams: list[Stream] = []
    for metric, value, valid in (("dw_entropy", hq, valid_q), ("dwk_entropy", hk, valid_k)):
        if valid:
            streams.append(Stream(name=names.attn(metric, layer_number), family=ATTN_DW.name, value=value,
                                  layer_number=layer_number, member=metric))
    return CheckOutput(scalars=scalars, streams=streams)
