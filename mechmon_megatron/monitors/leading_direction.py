"""Leading singular direction of each head's Delta2, and its persistence across windows.

A biased rounding error pushes the weights along one direction window after window; healthy
updates rotate. For successive non-overlapping windows k-1, k of one head, with ``u``, ``v`` the
leading left / right singular vectors of Delta2 (paper layout, ``d``-vectors)::

    persistence_k = |<u_k, u_{k-1}>| * |<v_k, v_{k-1}>|  in [0, 1]

the absolute cosine between the two windows' leading rank-1 terms ``u v^T`` (Frobenius inner
product of unit rank-1 matrices; the sign of a singular pair is arbitrary, hence the absolute
values). Random directions in ``d`` dimensions give ~1/d; a persisting one gives ~1.

Computed from the factors, never the ``d x d`` matrix: ``Delta2 = X Y^T`` with ``X = [dW_q, W_q]``,
``Y = [W_k, dW_k]`` (``d x 2h_d``, docs/METHOD.md section 4); thin QR ``X = Q_x R_x``, ``Y = Q_y R_y``
and the SVD of the small core ``R_x R_y^T = U S V^T`` give ``u = Q_x U[:, 0]``, ``v = Q_y V[:, 0]``.
float64 throughout. Pure torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mechmon_megatron.monitors.qk_increment import _check_qk_inputs

__all__ = ["delta2_leading_directions", "direction_persistence"]


def delta2_leading_directions(
    wq_prev: Tensor, wk_prev: Tensor, wq_now: Tensor, wk_now: Tensor, assume_finite: bool = False
) -> tuple[Tensor, Tensor]:
    """Unit leading left and right singular vectors of every head's Delta2.

    Args: as :func:`~mechmon_megatron.monitors.qk_increment.qk_increment_singular_values`
    (Megatron rows: ``wq`` ``[num_heads, head_dim, hidden]``, ``wk`` ``[num_groups, head_dim, hidden]``).

    Returns:
        ``(u, v)``, float64 ``[num_heads, hidden]`` each (sign arbitrary). A head with
        ``Delta2 = 0`` gets some unit vectors (its persistence is meaningless; the session skips
        heads whose window saw no update).
    """
    num_heads, num_groups, _, _ = _check_qk_inputs(wq_prev, wk_prev, wq_now, wk_now, assume_finite)
    group_of_head = torch.arange(num_heads, device=wq_prev.device) // (num_heads // num_groups)
    q0 = wq_prev.to(torch.float64)
    dq = wq_now.to(torch.float64) - q0
    k0 = wk_prev.to(torch.float64)
    dk = wk_now.to(torch.float64) - k0
    x = torch.cat([dq, q0], dim=1).transpose(1, 2)  # [H, d, 2h_d] = [dW_q, W_q]
    y = torch.cat([k0, dk], dim=1)[group_of_head].transpose(1, 2)  # [H, d, 2h_d] = [W_k, dW_k]
    qx, rx = torch.linalg.qr(x)
    qy, ry = torch.linalg.qr(y)
    uc, _, vch = torch.linalg.svd(rx @ ry.transpose(1, 2))
    u = (qx @ uc[:, :, :1]).squeeze(-1)
    v = (qy @ vch[:, :1, :].transpose(1, 2)).squeeze(-1)
    return u, v


def direction_persistence(u_prev: Tensor, v_prev: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``|<u, u_prev>| * |<v, v_prev>|`` per head (``[num_heads]``, float64, in [0, 1])."""
    if u.shape != u_prev.shape or v.shape != v_prev.shape or u.shape != v.shape:
        raise ValueError(f"direction shapes differ: u {tuple(u.shape)}, u_prev {tuple(u_prev.shape)}, "
                         f"v {tuple(v.shape)}, v_prev {tuple(v_prev.shape)}.")
    cu = (u.to(torch.float64) * u_prev.to(torch.float64)).sum(-1).abs()
    cv = (v.to(torch.float64) * v_prev.to(torch.float64)).sum(-1).abs()
    return (cu * cv).clamp(0.0, 1.0)
