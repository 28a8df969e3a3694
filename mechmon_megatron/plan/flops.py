"""FLOP and memory-traffic counts of one unit of each monitor component.

Counts follow the kernels as written (``session/attention_check.py`` and the core they call;
``monitors/mla_increment.py`` for multi-head latent attention), split into classes that run at
very different speeds on a GPU:

* ``gemm``: matrix products (``@`` / ``bmm``), 2 m n k each. Pinned against
  ``torch.utils.flop_counter.FlopCounterMode`` in tests/plan.
* ``factor``: LAPACK-class factorizations, textbook counts (Golub & Van Loan): Cholesky n^3/3;
  symmetric eigenvalues only 4n^3/3; Householder QR of m x n (R only) 2mn^2 - 2n^3/3, with Q
  formed 4mn^2 - 4n^3/3; singular values only of m x n (m >= n, R-bidiagonalization)
  2mn^2 + 2n^3.
* ``gemv``: matrix-vector products of the power iteration (memory bound), 2mn each.
* ``elementwise``: softmax, logs, histograms, norms (the router statistics), counted as one
  FLOP per arithmetic op.

``bytes`` is a rough count of device-memory traffic (inputs read, float64 copies written and
re-read), used only for the GPU estimate. Small terms (O(h^2) per head, the spectral statistics)
are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

FP64 = 8


@dataclass(frozen=True)
class Cost:
    """FLOPs per class and bytes of memory traffic."""

    gemm: float = 0.0
    factor: float = 0.0
    gemv: float = 0.0
    elementwise: float = 0.0
    bytes: float = 0.0

    @property
    def flops(self) -> float:
        return self.gemm + self.factor + self.gemv + self.elementwise

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, k: float) -> Cost:
        return Cost(*(getattr(self, f.name) * k for f in fields(self)))

    def as_dict(self) -> dict[str, float]:
        return {"flops": self.flops, **{f.name + ("_flops" if f.name != "bytes" else ""): getattr(self, f.name)
                                        for f in fields(self)}}


def _svdvals(m: int, n: int) -> float:
    """Singular values only of an m x n matrix (R-bidiagonalization)."""
    a, b = min(m, n), max(m, n)
    return 2.0 * b * a * a + 2.0 * a**3


def _qr_q(m: int, n: int) -> float:
    """Reduced Householder QR of m x n (m >= n) with Q formed."""
    return 4.0 * m * n * n - 4.0 * n**3 / 3.0


def _qr_r(m: int, n: int) -> float:
    """Householder QR of m x n, R only (either orientation: ``min`` reflectors)."""
    a, b = min(m, n), max(m, n)
    return 2.0 * b * a * a - 2.0 * a**3 / 3.0


def heads_cost(heads: int, groups: int, head_dim: int, hidden: int, method: str, weight_bytes: int) -> Cost:
    """``check_heads`` for ``heads`` query heads and ``groups`` K groups (one layer, one rank)."""
    H, G, h, d = heads, groups, float(head_dim), float(hidden)
    # Per-head dW_q / dW_k spectra (batched svdvals of [h, d]), both methods.
    dw_factor = (H + G) * _svdvals(head_dim, hidden)
    if method == "gram":
        # Block Grams of [dW, W] (3 bmm of [h, d] x [d, h] per head and per group); the cores
        # Delta2 (16 H h^3), Delta1 (8 H h^3), Delta3 (2 H h^3); the Grams of the cores (32 + 2 H h^3).
        gemm = 6 * h * h * d * (H + G) + 26 * H * h**3 + 34 * H * h**3
        # Cholesky of the [2h, 2h] and [h, h] Grams; eigvalsh of 2H [2h, 2h] and H [h, h] core Grams.
        factor = (H + G) * ((2 * h) ** 3 + h**3) / 3 + 2 * H * 4 * (2 * h) ** 3 / 3 + H * 4 * h**3 / 3
    elif method == "compressed":
        # Householder QR (R only) of the [d, 2h] factors; svdvals of the cores.
        gemm = 26 * H * h**3
        qr = (H + G) * (2 * d * (2 * h) ** 2 - 2 * (2 * h) ** 3 / 3)
        factor = qr + 2 * H * _svdvals(2 * head_dim, 2 * head_dim) + H * _svdvals(head_dim, head_dim)
    else:
        raise ValueError(f"qk method must be gram or compressed, got {method!r}")
    elements = (H + G) * h * d
    return Cost(gemm=gemm, factor=factor + dw_factor, bytes=elements * (4 * weight_bytes + 152))


def mla_heads_cost(
    heads: int, hidden: int, *, q_lora_rank: Optional[int], kv_lora_rank: int, d_nope: int, d_rope: int,
    weight_bytes: int,
) -> Cost:
    """``mla_delta2_singular_values`` for ``heads`` query heads of one MLA layer on one rank.

    Sizes: ``H = hidden``, ``r_q = q_lora_rank`` (None: no query latent), ``r_kv = kv_lora_rank``,
    ``d_qk = d_nope + d_rope``, ``n_kv = r_kv + d_rope``; ``m_q = min(H, 2 r_q)`` and
    ``m_kv = min(H, 2 n_kv)`` are the ranks of the stacked down projections ``[Qd; dQd]`` and
    ``[KVd; dKVd]``. Counts as the kernel issues them (multiply-add = 2):

    * once (every TP rank of the layer does it for its heads): thin Householder QRs (R only) of
      ``[H, 2 r_q]`` and ``[H, 2 n_kv]``, ``~8 H r_q^2 + 8 H n_kv^2``;
    * per head, GEMM: query coefficients ``4 d_qk r_q min(m_q, r_q) + 2 d_qk r_q m_q`` (``8 r_q^2 d_qk``
      when ``H >= 2 r_q``), key coefficients ``4 d_nope r_kv min(m_kv, r_kv) + 2 d_nope r_kv m_kv``
      (``(8 r_kv + 4 d_rope) r_kv d_nope``), cores ``2 x_w 2d_qk y_w + 2 x_c 2d_nope y_c``
      (``16 (d_qk^3 + d_nope^3)``), with ``x_w = min(m_q, 2 d_qk)``, ``y_w = min(m_kv, 2 d_qk)``
      the factors' rows and ``x_c``, ``y_c`` those rows capped at ``2 d_nope``;
    * per head, factorizations: thin QRs (R only) of ``[m_q, 2 d_qk]`` and ``[m_kv, 2 d_qk]``
      (``~16 r_q d_qk^2 + 16 n_kv d_qk^2``), ``svdvals`` of the ``[x_w, y_w]`` and ``[x_c, y_c]`` cores.
    * Without a query latent the query side is a thin QR of ``[H, 2 d_qk]`` per head (``~8 H d_qk^2``,
      no GEMM, no shared query QR), and ``m_q`` reads ``H``.

    ``bytes``: the weights read (prev and now) and their float64 copies written and re-read, about
    14 float64 passes per down-projection (or ``linear_q_proj``) element and 12 per up-projection
    element (the difference, the stacked copy, the QR's passes); a planning figure like the rest.
    """
    n_h, h = float(heads), int(hidden)
    d_qk, r_kv = d_nope + d_rope, kv_lora_rank
    n_kv = r_kv + d_rope
    m_kv = min(h, 2 * n_kv)
    key_gemm = 4.0 * d_nope * r_kv * min(m_kv, r_kv) + 2.0 * d_nope * r_kv * m_kv
    shared = _qr_r(h, 2 * n_kv)
    if q_lora_rank is None:
        m_q = h
        query_gemm, query_qr = 0.0, _qr_r(h, 2 * d_qk)
        down_elems, up_elems = float(n_kv) * h + n_h * d_qk * h, n_h * d_nope * r_kv
    else:
        r_q = q_lora_rank
        m_q = min(h, 2 * r_q)
        shared += _qr_r(h, 2 * r_q)
        query_gemm = 4.0 * d_qk * r_q * min(m_q, r_q) + 2.0 * d_qk * r_q * m_q
        query_qr = _qr_r(m_q, 2 * d_qk)
        down_elems, up_elems = float(r_q + n_kv) * h, n_h * (d_qk * r_q + d_nope * r_kv)
    x_w, y_w = min(m_q, 2 * d_qk), min(m_kv, 2 * d_qk)
    x_c, y_c = min(x_w, 2 * d_nope), min(y_w, 2 * d_nope)
    cores_gemm = 2.0 * x_w * (2 * d_qk) * y_w + 2.0 * x_c * (2 * d_nope) * y_c
    per_head_factor = query_qr + _qr_r(m_kv, 2 * d_qk) + _svdvals(x_w, y_w) + _svdvals(x_c, y_c)
    return Cost(
        gemm=n_h * (query_gemm + key_gemm + cores_gemm),
        factor=shared + n_h * per_head_factor,
        bytes=down_elems * (2 * weight_bytes + 14 * FP64) + up_elems * (2 * weight_bytes + 12 * FP64),
    )


def full_cost(
    q_rows: int, k_rows: int, hidden: int, method: str, rank: int, norm_iters: int, weight_bytes: int,
    oversample: int = 10, power_iters: int = 2,
) -> Cost:
    """``check_full``: dW_q and dW_k spectra of ``[rows, hidden]`` increments and ||W_q||_2."""
    total = Cost()
    n = hidden
    for m in (q_rows, k_rows):
        elems = float(m) * n
        if method == "randomized":
            keep = min(rank, m, n)
            ell = min(keep + oversample, m, n)
            gemm = (6 + 4 * power_iters) * elems * ell
            factor = (1 + power_iters) * _qr_q(m, ell) + power_iters * _qr_q(n, ell) + _svdvals(ell, n)
            passes = 8 + 2 * power_iters
        elif method == "exact":
            gemm, factor, passes = 0.0, _svdvals(m, n), 6
        else:
            raise ValueError(f"full-matrix method must be randomized or exact, got {method!r}")
        total = total + Cost(gemm=gemm, factor=factor, elementwise=5 * elems,
                             bytes=elems * (2 * weight_bytes + FP64 * passes))
    q_elems = float(q_rows) * n
    if norm_iters == 0:
        norm = Cost(factor=_svdvals(q_rows, n), bytes=q_elems * (weight_bytes + 2 * FP64))
    else:
        norm = Cost(gemv=(4 * norm_iters + 2) * q_elems,
                    bytes=q_elems * (weight_bytes + FP64 * (2 * norm_iters + 2)))
    return total + norm


def router_stats_cost(tokens: int, experts: int, logit_bytes: int = 2) -> Cost:
    """``summarize_routing`` of one micro-batch ``[tokens, experts]`` (in the forward hook):
    log-softmax, exp, p log p, sum, top-k and two histograms, about 12 ops per logit."""
    elems = float(tokens) * experts
    return Cost(elementwise=12 * elems, bytes=elems * (logit_bytes + 5 * 4 + 2 * FP64))


def router_weight_cost(experts: int, hidden: int, weight_bytes: int = 4) -> Cost:
    """``router_weight_similarity`` + ``router_conditioning_ratio`` of ``[experts, hidden]``
    (row norms, normalised sum, mean row, row distances: O(E d), no Gram is formed)."""
    elems = float(experts) * hidden
    return Cost(elementwise=10 * elems, bytes=elems * (2 * weight_bytes + 6 * FP64))
