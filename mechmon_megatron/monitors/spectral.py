"""Spectral statistics of a singular-value spectrum (docs/METHOD.md section 2).

For a matrix ``M`` with singular values ``s_1 >= ... >= s_r >= 0``:

* ``p_i = s_i^alpha / sum_j s_j^alpha``; ``alpha = 2`` (default) weights by energy,
  ``alpha = 1`` is the Roy-Vetterli effective rank.
* ``entropy`` ``H = -sum_i p_i log p_i`` in nats (``0 log 0 = 0``).
* ``effective_rank`` ``exp(H)`` (a count, between 1 and ``r``).
* ``normalized_entropy`` ``H / log(r_eff)`` in [0, 1], ``r_eff`` = number of singular values
  above the tolerance ``tol`` below; defined as 0 when ``r_eff <= 1``.
* ``stable_rank`` ``sum s^2 / max s^2`` (a count; independent of ``alpha``).
* ``fro_norm`` ``sqrt(sum s^2)`` (same unit as the singular values).

Metric keys returned by :func:`spectral_stats` (all shaped like the batch dims ``[...]``):
``entropy``, ``normalized_entropy``, ``effective_rank``, ``stable_rank``, ``fro_norm`` (float64),
``valid`` (bool), ``num_nonzero`` (int64).

Tail energy: when only the top ``k`` singular values are known (randomized SVD,
:func:`mechmon_megatron.monitors.update_spectrum.update_singular_values`), the exact
``||M||_F^2`` still is; ``tail_energy = fro_norm^2 - sum_k s_i^2`` (see
:func:`mechmon_megatron.monitors.update_spectrum.tail_energy`) is the mass the truncated
``alpha = 2`` distribution is missing. Normalising ``s_i^2`` by ``fro_norm^2`` instead of the
truncated sum gives the exact top-``k`` probabilities; the truncated entropy is then a lower
bound of the true one whenever the tail is spread over more singular values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mechmon_megatron.monitors._validation import check_floating

__all__ = ["SPECTRAL_STAT_KEYS", "spectral_stats"]

#: Keys of the dict returned by :func:`spectral_stats`.
SPECTRAL_STAT_KEYS = (
    "entropy",
    "normalized_entropy",
    "effective_rank",
    "stable_rank",
    "fro_norm",
    "valid",
    "num_nonzero",
)


def spectral_stats(singular_values: Tensor, alpha: float = 2.0, trusted: bool = False) -> dict[str, Tensor]:
    """Entropy-based statistics of one or many singular-value spectra.

    Args:
        singular_values: ``[..., r]`` non-negative singular values (any order; any real float
            dtype, upcast to float64 for the math). Leading dims are a batch (e.g. heads).
        alpha: exponent of the spectral distribution ``p_i ~ s_i^alpha``; any finite
            ``alpha > 0``. 2 = energy-normalised (default), 1 = Roy-Vetterli.
        trusted: the values come from an SVD (non-negative by construction): skip the sign check,
            which costs a host sync on an accelerator.

    Returns:
        dict with float64 tensors ``entropy`` (nats), ``normalized_entropy`` (in [0, 1]),
        ``effective_rank`` (count), ``stable_rank`` (count), ``fro_norm`` (unit of the input), a
        bool tensor ``valid`` and an int64 tensor ``num_nonzero``, all of shape ``[...]``.

        ``num_nonzero`` (``r_eff``) counts values ``> tol`` with
        ``tol = r * eps(input dtype) * max_i s_i`` (the ``matrix_rank`` convention: values below
        it are SVD round-off). Values ``<= tol`` are treated as exact zeros in ``p``.

        A spectrum is invalid (``valid = False``) if it contains NaN/Inf or is all zeros. Then
        every float statistic is exactly 0.0 (including ``effective_rank``) and
        ``num_nonzero = 0``: finite, never NaN, no exception, so a batched monitor keeps going
        and the caller decides (the session raises its non-finite alarm on ``~valid``).

    Raises:
        ValueError: ``singular_values`` is not a floating tensor, is 0-D, has an empty last dim,
            or contains a negative (finite) value; ``alpha`` is not a finite number > 0.
    """
    check_floating("singular_values", singular_values, min_ndim=1)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0 (2 = energy, 1 = Roy-Vetterli), got {alpha!r}.")
    r = singular_values.shape[-1]
    if r == 0:
        raise ValueError("singular_values has an empty last dimension; a spectrum needs at least one value.")
    eps = torch.finfo(singular_values.dtype).eps
    s = singular_values.to(torch.float64)

    finite = torch.isfinite(s).all(dim=-1)
    s = torch.where(finite.unsqueeze(-1), s, torch.zeros_like(s))  # scrub before any arithmetic
    if not trusted and bool((s < 0).any()):  # one host sync; a negative singular value is a caller bug
        raise ValueError(
            f"singular_values must be non-negative, got min {float(s.min()):.3e}; pass singular values "
            "(torch.linalg.svdvals), not eigenvalues."
        )

    smax = s.amax(dim=-1)
    valid = finite & (smax > 0)
    # Work with t = s / max so that s^alpha and s^2 never overflow or underflow as a whole.
    safe_max = torch.where(valid, smax, torch.ones_like(smax))
    t = s / safe_max.unsqueeze(-1)
    tol = r * eps  # relative to max, i.e. tol = r * eps * max s
    nonzero = t > tol
    num_nonzero = torch.where(valid, nonzero.sum(dim=-1), torch.zeros_like(smax, dtype=torch.int64))

    w = torch.where(nonzero, t.pow(alpha), torch.zeros_like(t))
    p = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p))
    entropy = (-plogp.sum(dim=-1)).clamp_min(0.0)  # rounding can give -1e-17 for a one-hot spectrum

    log_reff = torch.log(num_nonzero.clamp_min(1).to(torch.float64))
    normalized = torch.where(
        num_nonzero > 1, entropy / torch.where(num_nonzero > 1, log_reff, torch.ones_like(log_reff)), 0.0
    ).clamp(0.0, 1.0)  # H <= log r_eff up to rounding

    sum_t2 = (t * t).sum(dim=-1)
    zero = torch.zeros_like(smax)
    return {
        "entropy": torch.where(valid, entropy, zero),
        "normalized_entropy": torch.where(valid, normalized, zero),
        "effective_rank": torch.where(valid, torch.exp(entropy), zero),
        "stable_rank": torch.where(valid, sum_t2, zero),
        "fro_norm": torch.where(valid, safe_max * torch.sqrt(sum_t2), zero),
        "valid": valid,
        "num_nonzero": num_nonzero,
    }
