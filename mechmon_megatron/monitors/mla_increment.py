"""Per-head singular values of the QK increment ``Delta2`` for multi-head latent attention (MLA).

MLA (DeepSeek-V2/V3, Kimi K2; megatron-core ``MultiLatentAttention``) builds queries and keys
through low-rank "latent" projections. docs/METHOD.md sections 3-4 state ``Delta2`` for classic
attention; this module re-derives it for MLA and computes it without ever forming a
``hidden x hidden`` matrix or the per-head effective projections of all heads at once.

Layouts and names (Megatron rows ``[out, in]``; ``H`` = hidden, ``n_h`` heads,
``d_qk = d_nope + d_rope``, ``r_q`` = q_lora_rank, ``r_kv`` = kv_lora_rank,
``n_kv = r_kv + d_rope``):

* ``Qd = linear_q_down_proj.weight`` ``[r_q, H]``; ``g_q = q_layernorm.weight`` ``[r_q]``;
  ``Qup = linear_q_up_proj.weight`` ``[n_h * d_qk, r_q]`` (per head ``d_nope`` no-RoPE rows, then
  ``d_rope`` RoPE rows). Without a query latent (``q_lora_rank=None``):
  ``linear_q_proj.weight`` ``[n_h * d_qk, H]``.
* ``KVd = linear_kv_down_proj.weight`` ``[n_kv, H]``: rows ``[:r_kv]`` give the latent ``c_kv``
  (then ``kv_layernorm``, gamma ``g_kv`` ``[r_kv]``), rows ``[r_kv:]`` the RoPE key ``k_pe``, ONE
  head shared by every query head. ``Kup = linear_kv_up_proj.weight`` ``[n_h * (d_nope + d_v), r_kv]``
  (per head ``d_nope`` key rows then ``d_v`` value rows; only the key rows enter the logits).

Effective per-head projections (the input-dependent ``1/rms`` of each RMSNorm is left out, as for
every norm in front of a projection; docs/METHOD.md section 3), both ``[d_qk, H]``::

    A_h = Qup_h diag(g_q) Qd                                  (or linear_q_proj rows of head h)
    B_h = [ Kup_h^nope diag(g_kv) KVd[:r_kv] ;  KVd[r_kv:] ]

so that at zero relative position ``q . k = x A_h^T B_h x'^T``. With unsubscripted factors at
``t - delta`` and ``dA_h = A_h(t) - A_h`` (the exact difference of the products, not a first-order
expansion)::

    Delta2_h = dA_h^T B_h + A_h^T dB_h = X_h Y_h^T        (H x H)
    X_h = [dA_h^T, A_h^T],  Y_h = [B_h^T, dB_h^T]          (H x 2 d_qk)

Two streams: ``"content"`` restricts ``A_h`` and ``B_h`` to their ``d_nope`` no-RoPE rows (the
position-free part of the logit), ``"whole"`` keeps all ``d_qk`` rows.

The latent trick. Every row of ``A_h`` (prev and now) lies in the row space of
``S_q = [Qd; dQd]`` (``2 r_q x H``), every row of ``B_h`` in that of ``S_kv = [KVd; dKVd]``
(``2 n_kv x H``). One thin QR per layer, ``S^T = U R`` (``U`` orthonormal columns), gives
``Qd^T = U R_0`` and ``dQd^T = U R_d`` (the column blocks of ``R``), hence ``X_h = U_q K_h`` and
``Y_h = U_kv L_h`` with small coefficient matrices (``2 r_q x 2 d_qk`` and ``2 n_kv x 2 d_qk``) built
from the up projections, the gammas and ``R`` only. The differences telescope exactly::

    dA_h^T = dQd^T diag(g_q') Qup_h'^T + Qd^T (diag(g_q') dQup_h^T + diag(dg_q) Qup_h^T)

(primes: at ``t``), so every term is computed from an exact difference of upcast weights and its
error scales with ``||dW||``, not ``||W||`` (as in the classic kernel). Then thin QRs
``K_h = Q R_X`` and ``L_h = Q' R_Y`` give ``Delta2_h = (U_q Q) R_X R_Y^T (U_kv Q')^T``, and its
non-zero singular values are those of the ``2 d_qk x 2 d_qk`` core ``R_X R_Y^T``. Columns are
ordered ``[dA^nope, A^nope, dA^rope, A^rope]`` (and ``[B^nope, dB^nope, B^rope, dB^rope]``): the
leading ``2 d_nope`` columns of a QR factor are a QR factor of those columns, so one QR per head
and side serves both streams.

Cost (flops, counting a multiply-add as 2; ``H`` hidden):

* once per layer: two thin Householder QRs, ``~8 H r_q^2 + 8 H n_kv^2``;
* per head: coefficients ``8 r_q^2 d_qk`` (query) + ``(8 r_kv + 4 d_rope) r_kv d_nope`` (key), thin
  QRs ``~16 r_q d_qk^2 + 16 n_kv d_qk^2``, cores ``16 (d_qk^3 + d_nope^3)`` plus two small
  ``svdvals``; nothing of size ``H`` per head. (Forming ``A_h``, ``B_h`` explicitly costs
  ``4 d_qk r_q H + 4 d_nope r_kv H`` per head before its two ``H x 2 d_qk`` QRs, ``~16 H d_qk^2``.)
* Without a query latent the query side has no shared down projection: ``X_h`` is factored in
  hidden space per head (thin QR of ``H x 2 d_qk``, ``~8 H d_qk^2``: the classic kernel's query
  cost). A basis of all query rows would have ``min(H, 2 n_h d_qk)`` columns and cost
  ``~8 H (n_h d_qk)^2`` once, ``n_h`` times the per-head QRs together, so it is never cheaper.

Memory: the heads are processed ``head_chunk`` at a time; a chunk holds ``~head_chunk *
(2 r_q + 2 n_kv) * 2 d_qk`` float64 coefficients plus its upcast up-projection rows (hidden-space
``head_chunk * H * 2 d_qk`` without a query latent), besides the two per-layer ``R`` factors.

Precision: float64 throughout (inputs upcast first, so ``dW`` is exact); Householder QR is
column-wise backward stable, so the small ``dQd`` columns keep their own relative accuracy.
Tests: relative error <= 1e-5 on every singular value above 1e-6 of the largest against a dense
float64 reference (measured over 150 random small layers, fp64/fp32/bf16 inputs, ``dW`` from 1e-5
to 1 of ``W``, some rank 1: at most 6e-8 relative, 5e-12 of the largest value absolute).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from mechmon_megatron.monitors._validation import check_finite, check_floating, check_same_device
from mechmon_megatron.monitors.qk_increment import _fit

__all__ = ["MLA_STREAM_KEYS", "MLAWeights", "mla_delta2_singular_values"]

#: Keys of the dict returned by :func:`mla_delta2_singular_values`.
MLA_STREAM_KEYS = ("content", "whole")

_FIELDS = ("q_down", "q_norm", "q_up", "q_proj", "kv_down", "kv_norm", "kv_up")


class _Dims(NamedTuple):
    hidden: int
    r_q: int | None  # None: no query latent
    r_kv: int
    d_v: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MLAWeights:
    """The Q/K weights of one MLA layer at one step (Megatron row layout ``[out, in]``).

    Either ``q_down`` + ``q_up`` (+ optional ``q_norm``) or ``q_proj`` describes the query side.
    Any real floating dtype (bf16/fp16/fp32/fp64); all tensors on one device. Shapes use
    ``H`` = hidden, ``n_h`` heads, ``d_qk = d_nope + d_rope``.
    """

    kv_down: Tensor
    """``[kv_lora_rank + d_rope, H]`` ``linear_kv_down_proj.weight``: latent rows, then the shared RoPE key."""
    kv_up: Tensor
    """``[n_h * (d_nope + d_v), kv_lora_rank]`` ``linear_kv_up_proj.weight``: per head k rows then v rows."""
    kv_norm: Tensor | None = None
    """``[kv_lora_rank]`` ``kv_layernorm.weight`` (gamma); ``None`` means ones (no norm weight)."""
    q_down: Tensor | None = None
    """``[q_lora_rank, H]`` ``linear_q_down_proj.weight``; ``None`` when there is no query latent."""
    q_norm: Tensor | None = None
    """``[q_lora_rank]`` ``q_layernorm.weight`` (gamma); ``None`` means ones. Only with ``q_down``."""
    q_up: Tensor | None = None
    """``[n_h * d_qk, q_lora_rank]`` ``linear_q_up_proj.weight``: per head no-RoPE rows then RoPE rows."""
    q_proj: Tensor | None = None
    """``[n_h * d_qk, H]`` ``linear_q_proj.weight``, only when ``q_lora_rank`` is None."""

    def __post_init__(self) -> None:
        if self.q_proj is not None:
            if self.q_down is not None or self.q_up is not None or self.q_norm is not None:
                raise ValueError(
                    "MLAWeights: give either q_proj (no query latent) or q_down + q_up (+ q_norm), not both."
                )
        elif self.q_down is None or self.q_up is None:
            raise ValueError(
                "MLAWeights: the query side needs q_down and q_up (q_lora_rank set) or q_proj (q_lora_rank None)."
            )

    @property
    def has_q_latent(self) -> bool:
        """Whether the query goes through a latent (``q_lora_rank`` set)."""
        return self.q_proj is None

    def tensors(self) -> list[Tensor]:
        """Every tensor given (the ``None`` fields left out)."""
        return [t for t in (self.kv_down, self.kv_up, self.kv_norm, self.q_down, self.q_norm, self.q_up, self.q_proj)
                if t is not None]

    def map(self, fn: Callable[[Tensor], Tensor]) -> MLAWeights:
        """The same structure with ``fn`` applied to every tensor given (a copy, a device move)."""

        def each(t: Tensor | None) -> Tensor | None:
            return None if t is None else fn(t)

        return MLAWeights(kv_down=fn(self.kv_down), kv_up=fn(self.kv_up), kv_norm=each(self.kv_norm),
                          q_down=each(self.q_down), q_norm=each(self.q_norm), q_up=each(self.q_up),
                          q_proj=each(self.q_proj))


def mla_delta2_singular_values(
    prev: MLAWeights,
    now: MLAWeights,
    *,
    d_nope: int,
    d_rope: int,
    num_heads: int,
    head_chunk: int = 16,
    assume_finite: bool = False,
) -> dict[str, Tensor]:
    """Per-head singular values of ``Delta2`` of an MLA layer, content and whole streams (exact).

    Args:
        prev: the layer's weights at ``t - delta``.
        now: the same weights at ``t`` (same shapes; the same optional tensors present).
        d_nope: no-RoPE query/key head dim (megatron ``qk_head_dim``).
        d_rope: RoPE head dim (``qk_pos_emb_head_dim``), ``>= 0``.
        num_heads: query heads in the given up projections (heads per TP rank when sharded).
        head_chunk: heads processed together (bounds the memory; results agree to round-off).
        assume_finite: skip the NaN/Inf check (a pass over every input and a host sync) when the
            caller has already checked.

    Returns:
        ``{"content": [num_heads, k_c], "whole": [num_heads, k_w]}`` float64 singular values in
        descending order (unit: that of ``A_h^T B_h``, the product of the weights and gammas on
        the query and key paths), on the weights' device. ``k_w = min(H, 2 d_qk, 2 n_kv[, 2 r_q])``
        and ``k_c = min(H, 2 d_nope, 2 r_kv[, 2 r_q])`` (``2 r_q`` only with a query latent) bound
        the rank; shorter spectra are zero-padded.

    Raises:
        ValueError: a tensor has the wrong type or shape (the message names it, e.g.
            ``prev.kv_down``, and the expected shape), prev/now differ in shape or structure,
            tensors are on different devices, a size argument is out of range, or a weight holds
            NaN/Inf ("non-finite weights").
    """
    dims = _check_inputs(prev, now, d_nope=d_nope, d_rope=d_rope, num_heads=num_heads, head_chunk=head_chunk)
    if not assume_finite:
        check_finite([(f"{tag}.{n}", t) for tag, w in (("prev", prev), ("now", now)) for n, t in _present(w)])
    hidden, r_q, r_kv = dims.hidden, dims.r_q, dims.r_kv
    d_qk = d_nope + d_rope
    k_whole = min(hidden, 2 * d_qk, 2 * (r_kv + d_rope))
    k_content = min(hidden, 2 * d_nope, 2 * r_kv)
    if r_q is not None:
        k_whole, k_content = min(k_whole, 2 * r_q), min(k_content, 2 * r_q)

    kv_basis = _latent_basis(prev.kv_down, now.kv_down)  # [m_kv, 2 n_kv], once per layer
    q_basis = _latent_basis(prev.q_down, now.q_down) if r_q is not None else None
    out: dict[str, list[Tensor]] = {key: [] for key in MLA_STREAM_KEYS}
    for start in range(0, num_heads, head_chunk):
        heads = slice(start, min(start + head_chunk, num_heads))
        if q_basis is None:
            r_x = _query_factor_hidden(prev, now, heads, d_nope, d_qk)
        else:
            r_x = _query_factor_latent(prev, now, q_basis, heads, d_nope, d_qk)
        r_y = _key_factor_latent(prev, now, kv_basis, heads, d_nope, d_rope, dims.d_v)
        n2 = 2 * d_nope  # leading columns: the content stream (a leading block of a QR is a QR)
        core_content = r_x[..., :n2, :n2] @ r_y[..., :n2, :n2].mT
        core_whole = r_x @ r_y.mT
        out["content"].append(_fit(torch.linalg.svdvals(core_content), k_content))
        out["whole"].append(_fit(torch.linalg.svdvals(core_whole), k_whole))
    return {key: torch.cat(vals, dim=0) for key, vals in out.items()}


# --------------------------------------------------------------------------------------------------
# Factors. Convention (as in qk_increment.py): a factor R of a paper-layout matrix X (H x n)
# satisfies X = U R with U having orthonormal columns. Row-layout tensors are the transposes.
# --------------------------------------------------------------------------------------------------


def _latent_basis(down_prev: Tensor | None, down_now: Tensor | None) -> Tensor:
    """R factor ``[min(H, 2r), 2r]`` of ``S^T = [D^T, dD^T]`` for a down projection ``D`` ``[r, H]``.

    Column block ``[:, :r]`` is ``U^T D^T`` (upper trapezoidal: non-zero only in its first
    ``min(H, r)`` rows), block ``[:, r:]`` is ``U^T dD^T``. ``D`` comes first so that its block has
    the zero rows the per-head products skip; ``dD`` is the exact difference of the upcast weights,
    so its coefficients carry its own relative accuracy (column-wise backward stable QR).
    """
    assert down_prev is not None and down_now is not None  # internal: callers pass the latent side
    d0 = down_prev.to(torch.float64)
    dd = down_now.to(torch.float64) - d0
    return torch.linalg.qr(torch.cat([d0, dd], dim=0).mT, mode="r").R


def _head_rows(w: Tensor, heads: slice, per_head: int, take: slice) -> Tensor:
    """Rows ``take`` of each head's block of ``per_head`` rows, float64 ``[c, len(take), in]``."""
    c = heads.stop - heads.start
    block = w[heads.start * per_head : heads.stop * per_head].reshape(c, per_head, w.shape[-1])
    return block[:, take].to(torch.float64)


def _gammas(g_prev: Tensor | None, g_now: Tensor | None, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Float64 gamma at ``t`` and its increment (``None`` means ones, increment zero)."""
    if g_prev is None or g_now is None:
        ones = torch.ones(n, dtype=torch.float64, device=device)
        return ones, torch.zeros_like(ones)
    g0 = g_prev.to(torch.float64)
    g1 = g_now.to(torch.float64)
    return g1, g1 - g0


def _project(rows: Tensor, block: Tensor, m: int) -> Tensor:
    """``rows @ block^T`` for ``rows`` ``[c, n, r]``, ``block`` ``[m0, r]``, zero-padded to ``m`` columns.

    One 2-D GEMM over the chunk's rows (``[c*n, r] @ [r, m0]``): large and tensor-core friendly.
    """
    c, n, r = rows.shape
    out = (rows.reshape(c * n, r) @ block.mT).reshape(c, n, block.shape[0])
    return torch.nn.functional.pad(out, (0, m - block.shape[0]))


def _interleave(d_part: Tensor, w_part: Tensor, d_nope: int) -> Tensor:
    """Rows ``[d^nope, w^nope, d^rope, w^rope]`` from two ``[c, d_qk, m]`` blocks -> ``[c, 2 d_qk, m]``."""
    return torch.cat([d_part[:, :d_nope], w_part[:, :d_nope], d_part[:, d_nope:], w_part[:, d_nope:]], dim=1)


def _scaled_up_factors(
    up_prev: Tensor, up_now: Tensor, norm_prev: Tensor | None, norm_now: Tensor | None,
    heads: slice, rows_per_head: int, rows: slice, rank: int, device: torch.device,
) -> tuple[Tensor, Tensor, Tensor]:
    """An up projection times its latent norm's gamma, per head: ``(U diag(g), dU diag(g') +
    U diag(dg), U' diag(g'))``, each ``[c, rows, rank]``, primes at ``t``. The middle one is the
    increment of ``U diag(g)`` written so that each term comes from an exact difference of weights."""
    up0 = _head_rows(up_prev, heads, rows_per_head, rows)
    up1 = _head_rows(up_now, heads, rows_per_head, rows)
    g1, dg = _gammas(norm_prev, norm_now, rank, device)
    return up0 * (g1 - dg), (up1 - up0) * g1 + up0 * dg, up1 * g1


def _query_factor_latent(
    prev: MLAWeights, now: MLAWeights, basis: Tensor, heads: slice, d_nope: int, d_qk: int
) -> Tensor:
    """``R_X`` ``[c, min(m_q, 2 d_qk), 2 d_qk]`` of ``X_h = [dA_h^T, A_h^T]`` through the query latent."""
    assert prev.q_up is not None and now.q_up is not None and prev.q_down is not None
    r_q = prev.q_down.shape[0]
    m = basis.shape[0]
    r_0 = basis[: min(m, r_q), :r_q]  # U^T Qd^T: zero below row r_q (upper trapezoidal)
    r_d = basis[:, r_q:]  # U^T dQd^T
    # Row layout: A = Qup diag(g) Qd, so A^T's coefficients (U^T A^T)^T = (Qup diag(g)) R_block^T;
    # dA = Qup' diag(g') dQd + (dQup diag(g') + Qup diag(dg)) Qd: exact, each term from a difference.
    a0, e, up1_g1 = _scaled_up_factors(prev.q_up, now.q_up, prev.q_norm, now.q_norm, heads, d_qk,
                                       slice(0, d_qk), r_q, basis.device)  # [c, d_qk, r_q] each
    c = a0.shape[0]
    via_qd = _project(torch.cat([e, a0], dim=0), r_0, m)  # [2c, d_qk, m]
    da = via_qd[:c] + _project(up1_g1, r_d, m)
    coeff = _interleave(da, via_qd[c:], d_nope)  # [c, 2 d_qk, m] = K_h^T
    return torch.linalg.qr(coeff.mT, mode="r").R


def _query_factor_hidden(prev: MLAWeights, now: MLAWeights, heads: slice, d_nope: int, d_qk: int) -> Tensor:
    """``R_X`` of ``X_h`` in hidden space (no query latent): thin QR of ``[H, 2 d_qk]`` per head."""
    assert prev.q_proj is not None and now.q_proj is not None
    all_rows = slice(0, d_qk)
    a0 = _head_rows(prev.q_proj, heads, d_qk, all_rows)  # [c, d_qk, H]
    da = _head_rows(now.q_proj, heads, d_qk, all_rows) - a0
    return torch.linalg.qr(_interleave(da, a0, d_nope).mT, mode="r").R


def _key_factor_latent(
    prev: MLAWeights, now: MLAWeights, basis: Tensor, heads: slice, d_nope: int, d_rope: int, d_v: int
) -> Tensor:
    """``R_Y`` ``[c, min(m_kv, 2 d_qk), 2 d_qk]`` of ``Y_h = [B_h^T, dB_h^T]`` through the KV latent.

    The RoPE rows of ``B_h`` are ``KVd[r_kv:]`` itself (shared by all heads): their coefficients
    are columns of the basis factor, no per-head product.
    """
    r_kv = prev.kv_up.shape[1]
    n_kv = r_kv + d_rope
    m = basis.shape[0]
    t_0c = basis[: min(m, r_kv), :r_kv]  # U^T KVd[:r_kv]^T (zero below row r_kv)
    t_0r = basis[:, r_kv:n_kv]  # U^T KVd[r_kv:]^T
    t_dc = basis[:, n_kv : n_kv + r_kv]  # U^T dKVd[:r_kv]^T
    t_dr = basis[:, n_kv + r_kv :]  # U^T dKVd[r_kv:]^T
    b0, e, up1_g1 = _scaled_up_factors(prev.kv_up, now.kv_up, prev.kv_norm, now.kv_norm, heads, d_nope + d_v,
                                       slice(0, d_nope), r_kv, basis.device)  # [c, d_nope, r_kv] each
    c = b0.shape[0]
    via_kvd = _project(torch.cat([b0, e], dim=0), t_0c, m)  # [2c, d_nope, m]
    b0_nope = via_kvd[:c]
    db_nope = via_kvd[c:] + _project(up1_g1, t_dc, m)
    b0_rope = t_0r.mT.expand(c, d_rope, m)
    db_rope = t_dr.mT.expand(c, d_rope, m)
    coeff = torch.cat([b0_nope, db_nope, b0_rope, db_rope], dim=1)  # [c, 2 d_qk, m] = L_h^T
    return torch.linalg.qr(coeff.mT, mode="r").R


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _present(w: MLAWeights) -> list[tuple[str, Tensor]]:
    return [(name, t) for name in _FIELDS if (t := getattr(w, name)) is not None]


def _check_inputs(
    prev: MLAWeights, now: MLAWeights, *, d_nope: int, d_rope: int, num_heads: int, head_chunk: int
) -> _Dims:
    """Validate sizes, structure, shapes and devices; return hidden, r_q (or None), r_kv, d_v."""
    for name, value, low in (("d_nope", d_nope, 1), ("d_rope", d_rope, 0), ("num_heads", num_heads, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
    if isinstance(head_chunk, bool) or not isinstance(head_chunk, int) or head_chunk < 1:
        raise ValueError(f"head_chunk must be an int >= 1, got {head_chunk!r}.")
    for tag, w in (("prev", prev), ("now", now)):
        if not isinstance(w, MLAWeights):
            raise ValueError(f"{tag} must be an MLAWeights, got {type(w).__name__}.")
    for name in _FIELDS:
        a, b = getattr(prev, name), getattr(now, name)
        if (a is None) != (b is None):
            given, missing = ("prev", "now") if b is None else ("now", "prev")
            raise ValueError(f"{given}.{name} is given but {missing}.{name} is None; give both or neither.")
        if a is not None:
            check_floating(f"prev.{name}", a, ndim=1 if name.endswith("norm") else 2)
            check_floating(f"now.{name}", b, ndim=1 if name.endswith("norm") else 2)
    check_same_device(*[(f"{tag}.{n}", t) for tag, w in (("prev", prev), ("now", now)) for n, t in _present(w)])

    d_qk = d_nope + d_rope
    kv_up = prev.kv_up
    r_kv = kv_up.shape[1]
    hidden = prev.kv_down.shape[1]
    if r_kv < 1 or hidden < 1:
        raise ValueError(
            f"prev.kv_up {tuple(kv_up.shape)} and prev.kv_down {tuple(prev.kv_down.shape)} must be non-empty."
        )
    per_head, rem = divmod(kv_up.shape[0], num_heads)
    if rem or per_head < d_nope:
        raise ValueError(
            f"prev.kv_up must be [num_heads * (d_nope + d_v), kv_lora_rank] = [{num_heads} * ({d_nope} + d_v), "
            f"{r_kv}] with d_v >= 0, got {tuple(kv_up.shape)}."
        )
    expected: dict[str, tuple[int, ...]] = {
        "kv_down": (r_kv + d_rope, hidden),
        "kv_up": (num_heads * per_head, r_kv),
        "kv_norm": (r_kv,),
    }
    what = {
        "kv_down": f"[kv_lora_rank + d_rope, hidden] = [{r_kv} + {d_rope}, {hidden}]",
        "kv_up": f"[num_heads * (d_nope + d_v), kv_lora_rank] = [{num_heads * per_head}, {r_kv}]",
        "kv_norm": f"[kv_lora_rank] = [{r_kv}]",
    }
    r_q: int | None = None
    if prev.has_q_latent:
        assert prev.q_down is not None
        r_q = prev.q_down.shape[0]
        if r_q < 1:
            raise ValueError(f"prev.q_down must have q_lora_rank >= 1 rows, got {tuple(prev.q_down.shape)}.")
        expected |= {"q_down": (r_q, hidden), "q_up": (num_heads * d_qk, r_q), "q_norm": (r_q,)}
        what |= {
            "q_down": f"[q_lora_rank, hidden] = [{r_q}, {hidden}] (hidden from kv_down)",
            "q_up": f"[num_heads * (d_nope + d_rope), q_lora_rank] = [{num_heads} * {d_qk}, {r_q}]",
            "q_norm": f"[q_lora_rank] = [{r_q}]",
        }
    else:
        expected["q_proj"] = (num_heads * d_qk, hidden)
        what["q_proj"] = f"[num_heads * (d_nope + d_rope), hidden] = [{num_heads} * {d_qk}, {hidden}]"
    for name in expected:  # KV side first: kv_lora_rank and hidden are read from it
        for tag, w in (("prev", prev), ("now", now)):
            t = getattr(w, name)
            if t is not None and tuple(t.shape) != expected[name]:
                raise ValueError(f"{tag}.{name} must be {what[name]}, got {tuple(t.shape)}.")
    return _Dims(hidden=hidden, r_q=r_q, r_kv=r_kv, d_v=per_head - d_nope)
