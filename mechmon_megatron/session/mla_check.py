"""One multi-head latent attention (MLA) layer's per-head check: Delta2 spectra, content and whole.

Input: the snapshot taken ``delta`` steps ago and the weights now (``MLAHeads``). Output: scalars
for the writer and one detector stream per head. The detector pools the content (no-RoPE) stream
as the layer's ``attn_delta2`` members; the whole stream is recorded only (docs/METHOD.md section
4b says why). Pure torch, no host imports.
"""

from __future__ import annotations

import torch

from mechmon_megatron.detect.families import ATTN_DELTA2
from mechmon_megatron.monitors.mla_increment import mla_delta2_singular_values
from mechmon_megatron.monitors.spectral import spectral_stats
from mechmon_megatron.session import names
from mechmon_megatron.session.host import MLAHeads
from mechmon_megatron.session.records import CheckOutput, NonFinite, Partial, Stream


def check_mla_heads(layer_number: int, prev: MLAHeads, now: MLAHeads, alpha: float,
                    per_head_scalars: bool, head_chunk: int = 16) -> CheckOutput:
    """Content and whole Delta2 entropy per head for the MLA heads one rank reports."""
    device = now.weights.kv_down.device
    before = prev.weights.map(lambda t: t.to(device))
    tensors = before.tensors() + now.weights.tensors()
    finite = bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())  # one host sync
    if not finite:
        return CheckOutput(nonfinite=[NonFinite(layer_number, f"layer {layer_number}: non-finite MLA Q/K weights")])
    spectra = mla_delta2_singular_values(before, now.weights, d_nope=now.d_nope, d_rope=now.d_rope,
                                         num_heads=now.num_heads, head_chunk=head_chunk, assume_finite=True)
    content = spectral_stats(spectra["content"], alpha=alpha, trusted=True)
    whole = spectral_stats(spectra["whole"], alpha=alpha, trusted=True)
    sums = torch.stack([content["entropy"].sum(), content["entropy"].min(), content["normalized_entropy"].sum(),
                        content["effective_rank"].sum(), whole["entropy"].sum()])
    n = now.num_heads
    values = torch.cat([sums.to(torch.float64)] + [t.to(torch.float64) for t in (
        content["entropy"], content["valid"], content["fro_norm"], whole["entropy"], whole["valid"])]).tolist()
    (h_sum, h_min, norm_sum, rank_sum, whole_sum), rest = values[:5], values[5:]
    entropy, valid, fro, whole_entropy, whole_valid = (rest[i * n:(i + 1) * n] for i in range(5))
    scalars: dict[str, Partial] = {
        names.attn("delta2_entropy", layer_number): Partial("mean", h_sum, float(n)),
        names.attn("delta2_entropy_min", layer_number): Partial("min", h_min),
        names.attn("delta2_norm_entropy", layer_number): Partial("mean", norm_sum, float(n)),
        names.attn("delta2_eff_rank", layer_number): Partial("mean", rank_sum, float(n)),
        names.attn("delta2_whole_entropy", layer_number): Partial("mean", whole_sum, float(n)),
    }
    streams: list[Stream] = []
    for i in range(n):
        head = now.head_offset + i
        if not valid[i] and fro[i] == 0.0:
            continue  # no update in the window (e.g. frozen layer): nothing to judge
        value = entropy[i] if valid[i] else float("nan")
        streams.append(Stream(name=names.attn("delta2_entropy", layer_number, head), family=ATTN_DELTA2.name,
                              value=value, layer_number=layer_number, member=f"head_{head}", head=head))
        if per_head_scalars:
            scalars[names.attn("delta2_entropy", layer_number, head)] = Partial("value", value)
            scalars[names.attn("delta2_whole_entropy", layer_number, head)] = Partial(
                "value", whole_entropy[i] if whole_valid[i] else float("nan"))
    return CheckOutput(scalars=scalars, streams=streams)
