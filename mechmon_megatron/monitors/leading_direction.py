"""Leading singular direction of each head's Delta2, and its persistence across windows.

A biased rounding error pushes the weights along one direction window after window; healthy
updates rotate. For successive non-overlapping windows k-1, k of one head, with ``u``, ``v`` the
leading left / right singular vectors of Delta2 (paper layout, ``d``-vectors)::

    persistence_k = |<u_k, u_{k-1}>| * |<v_k, v_{k-1}>|  in [0, 1]

the absolute cosine between the two windows' leading rank-1 terms ``u v^T`` (Frobenius inner
product of unit rank-1 matrices; the sign of a singular pair is arbitrary, hence the absolute
values). Random directions in ``d`` dimensions give ~1/d; a persisting one gives ~1.

Computed from the factors, never the ``d x d`` matrix: ``Delta2 = X Y^T`` with ``X = [dW_q, W_q]``,
``Y = [W_k, dW_k]`` (``d x 2h_d``, docs/METHOD.md section 4); the kernel's factors ``R_x``, ``R_y``
(``R^T R = X^T X``: the Gram route, or thin QR) and the SVD of the small core
``R_x R_y^T = U S V^T`` give the spectrum ``S`` and ``u = X R_x^+ U[:, 0]``, ``v = Y R_y^+ V[:, 0]``
(``X R_x^+`` is ``Q_x`` on the range of ``X``): one core SVD serves the short window's entropy
and its direction. float64 throughout. Pure torch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from mechmon_megatron.monitors.qk_increment import (
    _check_qk_inputs,
    _fit,
    _gram_factors_x,
    _gram_factors_y,
    _qr_factors_x,
    _qr_factors_y,
)

__all__ = ["delta2_spectrum_and_directions", "direction_persistence"]


def delta2_spectrum_and_directions(
    wq_prev: Tensor,
    wk_prev: Tensor,
    wq_now: Tensor,
    wk_now: Tensor,
    method: Literal["gram", "compressed"] = "gram",
    assume_finite: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Singular values of every head's Delta2 and its unit leading left / right singular vectors.

    Args: as :func:`~mechmon_megatron.monitors.qk_increment.qk_increment_singular_values`
    (Megatron rows: ``wq`` ``[num_heads, head_dim, hidden]``, ``wk`` ``[num_groups, head_dim, hidden]``);
    ``method`` picks the factors ``R`` of ``X`` and ``Y`` (``R^T R = X^T X``) as that kernel does:
    ``gram`` (equilibrated Gram + Cholesky, ``eigh`` fallback) or ``compressed`` (thin QR).

    Returns:
        ``(s, u, v)``: ``s`` float64 ``[num_heads, min(hidden, 2 head_dim)]`` descending (the
        kernel's ``delta2``); ``u``, ``v`` float64 ``[num_heads, hidden]`` (sign arbitrary, the pair
        consistent: ``u^T Delta2 v = s_1``). With ``X = Q_X R_X`` (``Q_X = X R_X^+`` on the range) and
        ``R_X R_Y^T = U S V^T``: ``u = X R_X^+ U[:, 0]``, ``v = Y R_Y^+ V[:, 0]``, normalised. A head
        with ``Delta2 = 0`` gets arbitrary vectors (the session skips windows without update).
    """
    num_heads, num_groups, head_dim, hidden = _check_qk_inputs(wq_prev, wk_prev, wq_now, wk_now, assume_finite)
    group_of_head = torch.arange(num_heads, device=wq_prev.device) // (num_heads // num_groups)
    q0 = wq_prev.to(torch.float64)
    dq = wq_now.to(torch.float64) - q0
    k0 = wk_prev.to(torch.float64)
    dk = wk_now.to(torch.float64) - k0
    if method == "gram":
        (rx, _), (ry, _) = _gram_factors_x(q0, dq), _gram_factors_y(k0, dk)
    elif method == "compressed":
        (rx, _), (ry, _) = _qr_factors_x(q0, dq), _qr_factors_y(k0, dk)
    else:
        raise ValueError(f"method must be gram or compressed, got {method!r}.")
    ry = ry[group_of_head]
    uc, s, vch = torch.linalg.svd(rx @ ry.mT)
    x = torch.cat([dq, q0], dim=1).mT  # [H, d, 2h_d] = [dW_q, W_q]
    y = torch.cat([k0, dk], dim=1)[group_of_head].mT  # [H, d, 2h_d] = [W_k, dW_k]
    u = (x @ (torch.linalg.pinv(rx) @ uc[..., :, :1])).squeeze(-1)
    v = (y @ (torch.linalg.pinv(ry) @ vch[..., :1, :].mT)).squeeze(-1)
    k = min(hidden, 2 * head_dim)
    return _fit(s, k), torch.nn.functional.normalize(u, dim=-1), torch.nn.functional.normalize(v, dim=-1)


def direction_persistence(u_prev: Tensor, v_prev: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``|<u, u_prev>| * |<v, v_prev>|`` per head (``[num_heads]``, float64, in [0, 1])."""
    if u.shape != u_prev.shape or v.shape != v_prev.shape or u.shape != v.shape:
        raise ValueError(f"direction shapes differ: u {tuple(u.shape)}, u_prev {tuple(u_prev.shape)}, "
                         f"v {tuple(v.shape)}, v_prev {tuple(v_prev.shape)}.")
    cu = (u.to(torch.float64) * u_prev.to(torch.float64)).sum(-1).abs()
    cv = (v.to(torch.float64) * v_prev.to(torch.float64)).sum(-1).abs()
    return (cu * cv).clamp(0.0, 1.0)
