"""Singular values of the bilinear QK increments Delta1/2/3 per attention head (docs/METHOD.md sections 3-4).

Naming convention (paper layout vs Megatron layout):

* Megatron stores a head's query projection as rows: ``wq[h]`` is ``[head_dim, hidden]``. The paper
  writes ``W_q = wq[h].T``, a ``d x h_d`` (hidden x head_dim) matrix; likewise ``W_k = wk[g].T``.
* Unsubscripted factors are at step ``t - delta`` (``*_prev``), ``dW = W(t) - W(t - delta)``.
* ``Delta1 = W_q(t) W_k(t)^T - W_q W_k^T``, ``Delta2 = dW_q W_k^T + W_q dW_k^T``,
  ``Delta3 = dW_q dW_k^T``; all ``d x d``, ``Delta1 = Delta2 + Delta3``.
* GQA/MQA: ``num_heads % num_groups == 0``; query head ``h`` uses K group
  ``h // (num_heads // num_groups)``.

The shared factorisation (why one factorisation serves all three deltas). With
``X = [dW_q, W_q]`` and ``Y = [W_k, dW_k]`` (``d x 2h_d``) and ``P = [[0, I], [0, 0]]``::

    Delta2 = X Y^T,   Delta3 = X P Y^T,   Delta1 = X (I + P) Y^T.

For any factors ``X = U_X R_X`` and ``Y = U_Y R_Y`` with orthonormal columns in ``U`` (thin QR, or
``R = sqrt(Lambda) V^T`` from ``eigh(X^T X)``), the non-zero singular values of ``X C Y^T`` are those
of the small core ``R_X C R_Y^T`` (at most ``2h_d x 2h_d``): the ``d x d`` matrix is never built.
``Delta3`` is taken from separate ``h_d x h_d`` factors of ``dW_q`` and ``dW_k`` (cheaper core, and
its accuracy then scales with ``||dW||`` instead of ``||W||``).

Precision: all math is float64 (bf16/fp16/fp32/fp8 inputs are upcast first; the difference of two
upcast weights is then exact). ``compressed`` (Householder QR + ``svdvals``) is backward stable:
relative error <= 1e-6 on every singular value above 1e-6 of the largest (tests). ``gram`` squares
the condition number of the (column-equilibrated) factors: when they are nearly rank deficient
(e.g. an exactly low-rank ``dW`` plus round-off) it has an absolute error floor of ~sqrt(eps) ~
3e-8 of the largest value, so its relative error is <= 1e-6 only above ~1e-4 of the largest. That
floor does not move an entropy (a value at 1e-4 of the largest has ``p ~ 1e-8`` for alpha = 2).
Forming the Grams in fp32 was measured at ~1.5e-7 relative error on well-conditioned synthetic
layers but has a ~2e-4 absolute floor (of the largest value) on degenerate ones, so it is not
offered (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from mechmon_megatron.monitors._validation import (
    check_finite,
    check_floating,
    check_same_device,
    check_same_shape,
)

__all__ = ["QK_DELTA_KEYS", "QK_METHODS", "qk_increment_singular_values"]

#: Keys of the dict returned by :func:`qk_increment_singular_values`.
QK_DELTA_KEYS = ("delta1", "delta2", "delta3")
#: Accepted ``method`` values.
QK_METHODS = ("dense", "compressed", "gram")

QKMethod = Literal["dense", "compressed", "gram"]

# Smallest squared Cholesky pivot (of the unit-diagonal Gram) accepted before falling back to eigh:
# 1e-10 means the equilibrated factor has smallest singular value >= ~1e-5, where Cholesky's
# backward error (~n eps) is harmless; below it rank deficiency needs eigh's clamping.
_CHOL_MIN_PIVOT = 1e-10


def qk_increment_singular_values(
    wq_prev: Tensor,
    wk_prev: Tensor,
    wq_now: Tensor,
    wk_now: Tensor,
    method: QKMethod = "compressed",
    assume_finite: bool = False,
) -> dict[str, Tensor]:
    """Per-head singular values of the QK increments ``Delta1``, ``Delta2``, ``Delta3``.

    Args:
        wq_prev: ``[num_heads, head_dim, hidden]`` query weights at ``t - delta`` (Megatron rows).
        wk_prev: ``[num_groups, head_dim, hidden]`` key weights at ``t - delta``.
        wq_now: like ``wq_prev``, at step ``t``.
        wk_now: like ``wk_prev``, at step ``t``.
        method: ``"gram"`` (fastest: batched fp64 Gram products + Cholesky, ``eigh`` fallback),
            ``"compressed"`` (batched thin QR of the ``d x 2h_d`` factors; the accurate fast path)
            or ``"dense"`` (reference: builds the ``d x d`` matrices head by head; for tests).
        assume_finite: skip the NaN/Inf check (a pass over every input and a host sync) when the
            caller has already checked (the session checks once per layer).

    Returns:
        ``{"delta1", "delta2", "delta3"}``, each a float64 ``[num_heads, k]`` tensor of singular
        values in descending order, with ``k = min(hidden, 2 * head_dim)`` for all three (same unit
        as the weights squared). ``Delta3`` has rank ``<= head_dim``: it is zero-padded to ``k``.
        ``||Delta||_F^2`` is the sum of squares of a row (no non-zero value is dropped).

    Raises:
        ValueError: a weight is not a 3-D float tensor, prev/now shapes differ, head_dim/hidden of
            Q and K differ, ``num_heads % num_groups != 0``, tensors are on different devices,
            ``method`` is unknown, or a weight contains NaN/Inf (the message names the input and
            says "non-finite weights").
    """
    if method not in QK_METHODS:
        raise ValueError(f"method must be one of {QK_METHODS}, got {method!r}.")
    num_heads, num_groups, head_dim, hidden = _check_qk_inputs(wq_prev, wk_prev, wq_now, wk_now, assume_finite)
    k = min(hidden, 2 * head_dim)
    heads_per_group = num_heads // num_groups
    group_of_head = torch.arange(num_heads, device=wq_prev.device) // heads_per_group

    q0 = wq_prev.to(torch.float64)
    dq = wq_now.to(torch.float64) - q0
    k0 = wk_prev.to(torch.float64)
    dk = wk_now.to(torch.float64) - k0

    if method == "dense":
        return _dense(q0, dq, k0, dk, group_of_head, k)
    if method == "gram":
        rx, rdq = _gram_factors_x(q0, dq)
        ry, rdk = _gram_factors_y(k0, dk)
    else:
        rx, rdq = _qr_factors_x(q0, dq)
        ry, rdk = _qr_factors_y(k0, dk)
    return _cores_to_singular_values(
        rx, rdq, ry[group_of_head], rdk[group_of_head], head_dim, k, via_gram=method == "gram"
    )


def _check_qk_inputs(
    wq_prev: Tensor, wk_prev: Tensor, wq_now: Tensor, wk_now: Tensor, assume_finite: bool = False
) -> tuple[int, int, int, int]:
    """Validate shapes, dtypes, devices and finiteness; return (heads, groups, head_dim, hidden)."""
    for name, w in (("wq_prev", wq_prev), ("wk_prev", wk_prev), ("wq_now", wq_now), ("wk_now", wk_now)):
        check_floating(name, w, ndim=3)
    check_same_shape("wq_prev", wq_prev, "wq_now", wq_now)
    check_same_shape("wk_prev", wk_prev, "wk_now", wk_now)
    check_same_device(("wq_prev", wq_prev), ("wk_prev", wk_prev))
    num_heads, head_dim, hidden = wq_prev.shape
    num_groups, head_dim_k, hidden_k = wk_prev.shape
    if (head_dim_k, hidden_k) != (head_dim, hidden):
        raise ValueError(
            f"wk_prev must be [num_groups, head_dim={head_dim}, hidden={hidden}] to match wq_prev, "
            f"got {tuple(wk_prev.shape)}."
        )
    if min(num_heads, num_groups, head_dim, hidden) == 0:
        raise ValueError(f"wq_prev {tuple(wq_prev.shape)} and wk_prev {tuple(wk_prev.shape)} must be non-empty.")
    if num_heads % num_groups != 0:
        raise ValueError(
            f"num_heads (wq_prev.shape[0] = {num_heads}) must be divisible by num_groups "
            f"(wk_prev.shape[0] = {num_groups}) for GQA/MQA."
        )
    if not assume_finite:
        check_finite([("wq_prev", wq_prev), ("wk_prev", wk_prev), ("wq_now", wq_now), ("wk_now", wk_now)])
    return num_heads, num_groups, head_dim, hidden


# --------------------------------------------------------------------------------------------------
# Square-root factors. Convention: for a paper-layout matrix X (d x n), a "factor" R (r x n) satisfies
# X = U R with U (d x r) having orthonormal columns, i.e. R^T R = X^T X. Inputs are Megatron rows,
# so the paper X's columns are rows of the tensors here.
# --------------------------------------------------------------------------------------------------


def _gram_root(gram: Tensor) -> Tensor:
    """``[..., n, n]`` PSD Gram ``G`` -> ``[..., n, n]`` factor ``R`` with ``R^T R = G`` (float64).

    Columns are scaled to unit norm first (Jacobi equilibration) because ``dW`` and ``W`` columns
    differ by orders of magnitude; the factorisation's absolute error would otherwise swamp the
    ``dW`` part. Well-conditioned Grams (every Cholesky pivot^2 >= ``_CHOL_MIN_PIVOT``) use the
    Cholesky factor (backward stable, ~10x cheaper than ``eigh``); the rest fall back to
    :func:`_eigh_root`, which handles rank deficiency.
    """
    diag = torch.diagonal(gram, dim1=-2, dim2=-1).clamp_min(0.0)
    scale = torch.sqrt(diag)
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    scaled = gram * inv.unsqueeze(-1) * inv.unsqueeze(-2)
    chol, info = torch.linalg.cholesky_ex(scaled)
    pivots = torch.diagonal(chol, dim1=-2, dim2=-1)
    bad = (info != 0) | ~(pivots.square().amin(dim=-1) >= _CHOL_MIN_PIVOT)
    root = chol.mT  # R = L^T, upper triangular: R^T R = scaled
    if bool(bad.any()):  # one host sync; only degenerate heads pay for eigh
        root = root.clone()
        root[bad] = _eigh_root(scaled[bad])
    return root * scale.unsqueeze(-2)  # R D: (R D)^T (R D) = D scaled D = G


def _eigh_root(scaled: Tensor) -> Tensor:
    """Factor ``sqrt(Lambda) V^T`` of an equilibrated PSD Gram; eigenvalues below
    ``n * eps * lambda_max`` are round-off of rank deficiency and are clamped to zero (their square
    roots, ~1e-8, would otherwise appear as spurious singular values)."""
    n = scaled.shape[-1]
    evals, evecs = torch.linalg.eigh(scaled)
    tol = n * torch.finfo(torch.float64).eps * evals[..., -1:].clamp_min(0.0)
    root = torch.sqrt(torch.where(evals > tol, evals, torch.zeros_like(evals)))
    return root.unsqueeze(-1) * evecs.mT


def _block_gram(first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
    """Gram of ``[first^T, second^T]`` (rows ``[..., h_d, d]``) as ``[..., 2h_d, 2h_d]``, plus its
    leading ``first first^T`` block. Three ``h_d``-sized bmm instead of one ``2h_d`` one: symmetry
    saves a quarter of the flops and no ``[.., 2h_d, d]`` concatenation is allocated."""
    g11 = first @ first.mT
    g12 = first @ second.mT
    g22 = second @ second.mT
    top = torch.cat([g11, g12], dim=-1)
    bottom = torch.cat([g12.mT, g22], dim=-1)
    return torch.cat([top, bottom], dim=-2), g11


def _gram_factors_x(q0: Tensor, dq: Tensor) -> tuple[Tensor, Tensor]:
    """Factors of ``X = [dW_q, W_q]`` (``[H, 2h_d, 2h_d]``) and of ``dW_q`` (``[H, h_d, h_d]``)."""
    gram_x, gram_dq = _block_gram(dq, q0)
    return _gram_root(gram_x), _gram_root(gram_dq)


def _gram_factors_y(k0: Tensor, dk: Tensor) -> tuple[Tensor, Tensor]:
    """Factors of ``Y = [W_k, dW_k]`` and of ``dW_k``, once per K group."""
    gram_y_swapped, gram_dk = _block_gram(dk, k0)  # Gram of [dW_k, W_k]
    ry_swapped = _gram_root(gram_y_swapped)
    return _swap_halves(ry_swapped), _gram_root(gram_dk)


def _swap_halves(r: Tensor) -> Tensor:
    """Factor of ``[B, A]`` from a factor of ``[A, B]`` (a column permutation of R)."""
    half = r.shape[-1] // 2
    return torch.cat([r[..., half:], r[..., :half]], dim=-1)


def _qr_factors_x(q0: Tensor, dq: Tensor) -> tuple[Tensor, Tensor]:
    """Thin-QR factors of ``X = [dW_q, W_q]`` and of its leading block ``dW_q`` (same QR)."""
    head_dim = q0.shape[-2]
    x = torch.cat([dq, q0], dim=-2).mT  # [H, d, 2h_d], paper layout
    r = torch.linalg.qr(x, mode="r").R  # [H, min(d, 2h_d), 2h_d]
    # QR of [A, B] restricted to A's columns is a QR of A: R[:h_d, :h_d] factors dW_q.
    return r, r[..., : min(r.shape[-2], head_dim), :head_dim]


def _qr_factors_y(k0: Tensor, dk: Tensor) -> tuple[Tensor, Tensor]:
    """Thin-QR factors of ``Y = [W_k, dW_k]`` and of ``dW_k``, once per K group (``dW_k`` first)."""
    ry_swapped, rdk = _qr_factors_x(k0, dk)  # factors of [dW_k, W_k] and dW_k
    return _swap_halves(ry_swapped), rdk


def _cores_to_singular_values(
    rx: Tensor, rdq: Tensor, ry: Tensor, rdk: Tensor, head_dim: int, k: int, via_gram: bool = False
) -> dict[str, Tensor]:
    """Singular values of the small cores ``R_X C R_Y^T`` (per head; K factors already gathered).

    ``via_gram``: take them as ``sqrt(eigvalsh(K K^T))`` (about 2x cheaper than ``svdvals``; the
    same squared-conditioning accuracy class as the Gram factors, so only for ``method="gram"``).
    """
    core2 = rx @ ry.mT  # Delta2 = X Y^T
    core1 = core2 + rx[..., :head_dim] @ ry[..., head_dim:].mT  # Delta1 = X (I + P) Y^T
    core3 = rdq @ rdk.mT  # Delta3 = dW_q dW_k^T
    singular_values = _gram_singular_values if via_gram else torch.linalg.svdvals
    s12 = singular_values(torch.cat([core1, core2], dim=0))  # one batched LAPACK call
    s1, s2 = s12.chunk(2, dim=0)
    return {
        "delta1": _fit(s1, k),
        "delta2": _fit(s2, k),
        "delta3": _fit(singular_values(core3), k),
    }


def _gram_singular_values(core: Tensor) -> Tensor:
    """Descending singular values of ``[..., m, n]`` from the eigenvalues of the smaller Gram."""
    gram = core @ core.mT if core.shape[-2] <= core.shape[-1] else core.mT @ core
    return torch.linalg.eigvalsh(gram).flip(-1).clamp_min(0.0).sqrt()


def _fit(s: Tensor, k: int) -> Tensor:
    """Truncate or zero-pad descending singular values ``[..., m]`` to ``[..., k]``."""
    m = s.shape[-1]
    if m >= k:
        return s[..., :k].contiguous()
    return torch.nn.functional.pad(s, (0, k - m))


def _dense(q0: Tensor, dq: Tensor, k0: Tensor, dk: Tensor, group_of_head: Tensor, k: int) -> dict[str, Tensor]:
    """Reference: build each ``d x d`` Delta explicitly, head by head, and take ``svdvals``."""
    out: dict[str, list[Tensor]] = {key: [] for key in QK_DELTA_KEYS}
    for h, g in enumerate(group_of_head.tolist()):
        wq, dwq = q0[h].mT, dq[h].mT  # paper layout, d x h_d
        wk, dwk = k0[g].mT, dk[g].mT
        delta1 = (wq + dwq) @ (wk + dwk).mT - wq @ wk.mT
        delta2 = dwq @ wk.mT + wq @ dwk.mT
        delta3 = dwq @ dwk.mT
        for key, delta in zip(QK_DELTA_KEYS, (delta1, delta2, delta3)):
            out[key].append(torch.linalg.svdvals(delta)[:k])
    return {key: torch.stack(vals) for key, vals in out.items()}
