"""Singular spectra of weight increments ``dW = W(t) - W(t - delta)`` (docs/METHOD.md section 5).

Two entry points:

* :func:`per_head_update_singular_values` -- per-head ``dW_q`` / ``dW_k`` spectra, batched over
  heads (``[heads, head_dim, hidden]`` -> ``[heads, min(head_dim, hidden)]``).
* :func:`update_singular_values` -- one (or a batch of) full ``[m, n]`` increments, exact or
  randomized (Halko, Martinsson & Tropp 2011) with a certified a-posteriori error bound.

All math is float64 (inputs of any float dtype are upcast first, so ``dW`` is exact).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from mechmon_megatron.monitors._validation import check_finite, check_floating, check_same_shape

__all__ = ["per_head_update_singular_values", "spectral_norm", "tail_energy", "update_singular_values"]

UpdateMethod = Literal["exact", "randomized"]

# Fixed seed of the private generator used when the caller passes none: reproducible, and the
# monitor must never advance the training job's global RNG.
_DEFAULT_SEED = 0


def _increment(
    name_prev: str, w_prev: Tensor, name_now: str, w_now: Tensor, ndim: int | None, assume_finite: bool = False
) -> Tensor:
    """Validate a prev/now pair and return ``dW`` in float64."""
    if ndim is None:
        check_floating(name_prev, w_prev, min_ndim=2)
    else:
        check_floating(name_prev, w_prev, ndim=ndim)
    check_floating(name_now, w_now)
    check_same_shape(name_prev, w_prev, name_now, w_now)
    if w_prev.shape[-1] == 0 or w_prev.shape[-2] == 0:
        raise ValueError(f"{name_prev} must have non-empty matrix dims, got shape {tuple(w_prev.shape)}.")
    if not assume_finite:
        check_finite([(name_prev, w_prev), (name_now, w_now)])
    return w_now.to(torch.float64) - w_prev.to(torch.float64)


def per_head_update_singular_values(w_prev: Tensor, w_now: Tensor, assume_finite: bool = False) -> Tensor:
    """Singular values of each head's increment ``dW[h] = w_now[h] - w_prev[h]``.

    Args:
        w_prev: ``[heads, head_dim, hidden]`` weights at ``t - delta`` (Megatron rows; the spectrum
            of a matrix and of its transpose are the same, so the layout does not matter).
        w_now: same shape, at step ``t``.
        assume_finite: skip the NaN/Inf check when the caller has made it.

    Returns:
        float64 ``[heads, min(head_dim, hidden)]``, descending, same unit as the weights.

    Raises:
        ValueError: not 3-D float tensors, shapes/devices differ, empty dims, or NaN/Inf
            (message names the input).

    Uses batched fp64 ``svdvals`` (LAPACK gesdd: QR of the wide matrix, then a small SVD), which is
    backward stable: absolute error ~eps * ||dW||_2 on every value. A Gram ``eigvalsh`` path is ~5x
    faster on CPU but squares the condition number (values below ~1e-8 of the largest lose all
    digits, ~1e-4 relative error at 1e-6); see docs/PERFORMANCE.md.
    """
    dw = _increment("w_prev", w_prev, "w_now", w_now, ndim=3, assume_finite=assume_finite)
    return torch.linalg.svdvals(dw)


def update_singular_values(
    w_prev: Tensor,
    w_now: Tensor,
    method: UpdateMethod = "exact",
    rank: int | None = None,
    oversample: int = 10,
    power_iters: int = 2,
    generator: torch.Generator | None = None,
    assume_finite: bool = False,
) -> dict[str, Tensor]:
    """Singular values of a full-matrix increment ``dW = w_now - w_prev`` (``[..., m, n]``).

    Args:
        w_prev: ``[..., m, n]`` weights at ``t - delta`` (leading dims are a batch).
        w_now: same shape, at step ``t``.
        method: ``"exact"`` (fp64 ``svdvals``) or ``"randomized"`` (range finder, below).
        rank: number of singular values to return. Required for ``"randomized"``; for
            ``"exact"`` ``None`` returns all ``min(m, n)``.
        oversample: extra random columns of the sketch (randomized only), ``>= 0``.
        power_iters: subspace (power) iterations, ``>= 0``; each sharpens the sketch on decaying
            spectra at the cost of two passes over ``dW``.
        generator: ``torch.Generator`` on ``w_prev.device`` for the Gaussian sketch. ``None`` uses a
            private generator seeded with 0 (reproducible; the global RNG is never touched).
        assume_finite: skip the NaN/Inf check when the caller has made it.

    Returns:
        dict of float64 tensors: ``singular_values`` ``[..., rank]`` (descending; ``rank`` capped at
        ``min(m, n)``), ``fro_norm`` ``[...]`` (exact ``||dW||_F``) and ``error_bound`` ``[...]``
        (0 for ``"exact"``).

    Randomized method and its certificate: ``Q`` (``m x l``, ``l = min(rank + oversample, m, n)``)
    is an orthonormal basis of ``(dW dW^T)^q dW Omega`` (Gaussian ``Omega``, re-orthonormalised by
    QR after every product). The estimates are the top ``rank`` singular values of ``Q^T dW``, and
    ``error_bound = ||dW - Q Q^T dW||_F`` is computed exactly after the fact. Then, for every ``i``::

        0 <= sigma_i(dW) - sigma_i(Q^T dW) <= ||dW - Q Q^T dW||_2 <= error_bound

    The left inequality holds because ``Q Q^T`` is an orthogonal projection (singular values of
    ``P A`` never exceed those of ``A``); the right one is Weyl's inequality applied to
    ``dW = Q Q^T dW + (I - Q Q^T) dW``. So the estimates are certified lower bounds, up to
    floating-point round-off (~eps * ||dW||). Use :func:`tail_energy` with ``fro_norm`` to get the
    energy outside the returned values (what an ``alpha = 2`` entropy of the truncated spectrum
    misses).

    Raises:
        ValueError: bad shapes/dtypes/devices, NaN/Inf in an input (named), unknown ``method``,
            ``rank`` missing (randomized) or ``< 1``, negative ``oversample``/``power_iters``.
    """
    if method not in ("exact", "randomized"):
        raise ValueError(f"method must be 'exact' or 'randomized', got {method!r}.")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"rank must be a positive int or None, got {rank!r}.")
    if method == "randomized" and rank is None:
        raise ValueError("rank is required for method='randomized' (e.g. rank=64).")
    if isinstance(oversample, bool) or not isinstance(oversample, int) or oversample < 0:
        raise ValueError(f"oversample must be an int >= 0, got {oversample!r}.")
    if isinstance(power_iters, bool) or not isinstance(power_iters, int) or power_iters < 0:
        raise ValueError(f"power_iters must be an int >= 0, got {power_iters!r}.")
    dw = _increment("w_prev", w_prev, "w_now", w_now, ndim=None, assume_finite=assume_finite)
    m, n = dw.shape[-2:]
    fro = torch.linalg.matrix_norm(dw, ord="fro")
    keep = min(m, n) if rank is None else min(rank, m, n)

    if method == "exact":
        s = torch.linalg.svdvals(dw)[..., :keep]
        return {"singular_values": s.contiguous(), "fro_norm": fro, "error_bound": torch.zeros_like(fro)}

    if generator is None:
        generator = torch.Generator(device=dw.device)
        generator.manual_seed(_DEFAULT_SEED)
    elif generator.device != dw.device:
        raise ValueError(f"generator is on {generator.device} but w_prev is on {dw.device}.")
    ell = min(keep + oversample, m, n)
    omega = torch.randn(*dw.shape[:-2], n, ell, dtype=torch.float64, device=dw.device, generator=generator)
    q = torch.linalg.qr(dw @ omega).Q  # [..., m, ell]
    for _ in range(power_iters):
        # Orthonormalise between products so that the dominant direction does not swamp the rest.
        z = torch.linalg.qr(dw.mT @ q).Q
        q = torch.linalg.qr(dw @ z).Q
    b = q.mT @ dw  # [..., ell, n]
    s = torch.linalg.svdvals(b)[..., :keep]
    # Residual formed explicitly, not as fro^2 - ||B||_F^2, which cancels catastrophically when the
    # sketch captures almost all the energy.
    error_bound = torch.linalg.matrix_norm(dw - q @ b, ord="fro")
    return {"singular_values": s.contiguous(), "fro_norm": fro, "error_bound": error_bound}


def tail_energy(fro_norm: Tensor, singular_values: Tensor) -> Tensor:
    """Energy outside a truncated spectrum: ``max(fro_norm^2 - sum_i s_i^2, 0)``.

    Args:
        fro_norm: ``[...]`` exact Frobenius norm of the matrix.
        singular_values: ``[..., k]`` its top ``k`` singular values (same unit as ``fro_norm``).

    Returns:
        ``[...]`` float64, in the unit of ``fro_norm`` squared. Clamped at 0 against round-off.
    """
    s = singular_values.to(torch.float64)
    return (fro_norm.to(torch.float64) ** 2 - (s * s).sum(dim=-1)).clamp_min(0.0)


def spectral_norm(weight: Tensor, power_iters: int = 16, generator: torch.Generator | None = None) -> Tensor:
    """``||W||_2`` of a ``[m, n]`` matrix: by power iteration, or exactly with ``power_iters=0``.

    Power iteration runs on ``W^T W`` from a Gaussian start (float64), ``2 * power_iters``
    matrix-vector products; the estimate ``||W v|| / ||v||`` is a certified lower bound of
    ``||W||_2`` for every start (no vector is stretched more than the largest singular value) and
    converges geometrically at rate ``(s_2 / s_1)^2`` per iteration. The monitor tracks its
    trend, so a slowly converging estimate costs accuracy, never a false certificate.

    Args:
        weight: ``[m, n]`` float tensor (any float dtype; upcast to float64).
        power_iters: ``>= 0``; 0 computes the exact norm with an SVD.
        generator: for the start vector (on ``weight.device``); ``None`` = private, seeded 0.

    Returns:
        float64 scalar tensor, same unit as ``weight``.
    """
    check_floating("weight", weight, ndim=2)
    if isinstance(power_iters, bool) or not isinstance(power_iters, int) or power_iters < 0:
        raise ValueError(f"power_iters must be an int >= 0, got {power_iters!r}.")
    w = weight.to(torch.float64)
    if power_iters == 0:
        return torch.linalg.matrix_norm(w, ord=2)
    if generator is None:
        generator = torch.Generator(device=w.device)
        generator.manual_seed(_DEFAULT_SEED)
    v = torch.randn(w.shape[1], dtype=torch.float64, device=w.device, generator=generator)
    for _ in range(power_iters):
        # Normalised every step; the norm stays on the device (no host sync until the caller reads it).
        v = w.mT @ (w @ v)
        v = v / torch.linalg.vector_norm(v).clamp_min(torch.finfo(torch.float64).tiny)
    return torch.linalg.vector_norm(w @ v)
