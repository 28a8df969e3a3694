"""Dense float64 references shared by the tests of every host: Delta2 formed explicitly."""

from __future__ import annotations

import torch

from mechmon_megatron.monitors.spectral import spectral_stats


def dense_delta2_entropy(wq0: torch.Tensor, wk0: torch.Tensor, wq1: torch.Tensor, wk1: torch.Tensor,
                         alpha: float = 2.0) -> torch.Tensor:
    """Per-head spectral entropy (nats) of ``Delta2 = dW_q^T W_k + W_q^T dW_k`` formed as the
    ``hidden x hidden`` matrix, float64. Rows ``[heads, head_dim, hidden]``, keys ``[groups,
    head_dim, hidden]`` (GQA: head ``h`` uses group ``h // (heads / groups)``); returns ``[heads]``."""
    group = wq0.shape[0] // wk0.shape[0]
    out = []
    for h in range(wq0.shape[0]):
        q0, q1, k0, k1 = wq0[h].double(), wq1[h].double(), wk0[h // group].double(), wk1[h // group].double()
        delta2 = (q1 - q0).T @ k0 + q0.T @ (k1 - k0)
        out.append(spectral_stats(torch.linalg.svdvals(delta2)[None], alpha=alpha)["entropy"][0])
    return torch.stack(out)
