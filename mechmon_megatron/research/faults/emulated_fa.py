"""Emulated low-precision FlashAttention (forward and FA-2 backward) in pure PyTorch.

Imports torch only. The kernel runs on any device (CPU included); it is used to study the BF16
FlashAttention failure of Qiu & Yao (docs/METHOD.md section 8) on small models without a GPU.

Naming convention (shapes use B batch, H heads, N query length, M key length, D head dim of
queries and keys, E head dim of values and of the output; ``E == D`` except in multi-head latent
attention, where ``D = qk_head_dim + qk_pos_emb_head_dim`` and ``E = v_head_dim``):

- ``q_BHND``, ``k_BHMD``, ``v_BHME``: inputs (FP32 master values; K and V already repeated to H
  heads when the model uses GQA).
- ``s``: scaled scores ``q k^T * softmax_scale`` of one tile, FP32.
- ``m``: running row max of ``s``; ``m_used``: the max actually subtracted (equal to ``m``
  unless the tie-shift fix moves it); ``l``: running row sum of ``exp(s - m_used)``.
- ``p_bar``: ``exp(s - m_used)`` in a forward tile; ``p``: ``exp(s - lse)`` in a backward tile.
- ``lse_BHN``: per-row logsumexp saved for the backward; ``tied_BHN``: row max attained twice.
- ``delta_BHN``: ``rowsum(dO * O_used)`` over the value dim E, the FA-2 quantity whose
  low-precision O ``[B,H,N,E]`` is the failure site.

BF16 emulation (``emulate_bf16=True``): values are rounded with ``x.to(torch.bfloat16)`` and
cast back, following the CPU recipe of docs/METHOD.md section 8: Q, K, V are cast to BF16; S is
computed in FP32; ``p_bar`` is cast to BF16 before ``p_bar @ V``; accumulation is FP32; O is
rounded to BF16 at the end (``O = acc / l``). In the backward ``P``, ``dO`` and ``dS`` are
rounded to BF16 before their matrix products (the operands a BF16 FA-2 kernel feeds its MMAs),
``delta = rowsum(dO * O_bf16)``, and dQ, dK, dV are returned rounded to BF16. With
``emulate_bf16=False`` nothing is rounded and the kernel is an exact tiled FA-2 in the input
dtype (FP32, or FP64 for finite-difference checks).

Tie-shift fix (``tie_shift_beta``, opt-in). Tie detection is done on the *running* max of the
online softmax, exactly: alongside ``m`` the kernel keeps ``count``, the number of entries seen
so far equal to ``m`` (reset when a tile raises the max, incremented when a tile attains it).
Before each tile, ``m_used`` is ``beta * m`` if ``count > 1`` and ``m > 0``, ``0`` if
``count > 1`` and ``m < 0``, else ``m``, with the shift ``m_used - m`` capped at
``tie_shift_cap`` nats (default 64) so that ``exp`` cannot underflow to an all-zero row.
``acc`` and ``l`` are rescaled by ``exp(m_used_old - m_used_new)`` whenever ``m_used``
changes, so the result is the same softmax (shift invariance) and every ``p_bar`` computed
while the running max is tied is ``< 1``. A tile processed before the tie appears (count still
1) keeps its single ``p_bar == 1`` entry; a single such entry carries no rounding bias. A row
whose max is exactly ``0.0`` cannot be shifted by this rule and is left as is. The
``"tied_rows"`` fault mode uses the final count (the row max of the whole row is attained
more than once).

Fault injection: see :mod:`mechmon_megatron.research.faults.fault_config`. When active the backward
uses ``O_used = O + strength * ulp_bf16(O) * sign(O)`` in ``delta`` only (on all rows, or on
tied rows only). With the tie-shift fix on, a ``"tied_rows"`` fault is suppressed: the fix
removes the ``p_bar == 1`` entries that cause the biased rounding. An ``"all_rows"`` fault is
an abstract amplified bias and still applies. In the ``fp32_o`` control arm the bias is added
to the FP32 O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mechmon_megatron.research.faults.fault_config import FaultConfig

BF16_MANTISSA_BITS = 7
"""Explicit significand bits of BF16: the ulp at x is 2 ** (floor(log2|x|) - 7)."""
BF16_MIN_EXPONENT = -126
"""Smallest normal exponent of BF16 (same as FP32)."""


@dataclass(kw_only=True, slots=True)
class EmulatedFAConfig:
    """Options of the emulated kernel (tiling, precision emulation, control arm, fix)."""

    block_q: int = 64
    """Query rows per tile."""

    block_k: int = 64
    """Key columns per tile."""

    emulate_bf16: bool = True
    """Round Q, K, V, P_bar, O (and the backward's MMA operands) to BF16; False = exact FA-2."""

    fp32_o: bool = False
    """Control arm: keep O in FP32 (no final rounding), so ``delta`` uses the FP32 O."""

    tie_shift_beta: float | None = None
    """Tie-shift fix factor (Qiu & Yao use 2..8); ``None`` disables the fix."""

    tie_shift_cap: float = 64.0
    """Largest shift ``m_used - m`` in nats (natural-log units of the scores). Qiu & Yao's
    ``beta * m`` is unbounded and underflows FP32 ``exp`` (every ``p_bar`` 0, NaN output) once
    ``(beta - 1) * m > ~87``; the cap keeps ``max p_bar >= exp(-cap)``. Below the cap the rule
    is theirs exactly."""

    def __post_init__(self) -> None:
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(
                f"emulated_fa.block_q and block_k must be >= 1, got {self.block_q}, {self.block_k}."
            )
        if self.tie_shift_beta is not None and not self.tie_shift_beta > 1.0:
            raise ValueError(
                "emulated_fa.tie_shift_beta must be > 1 (Qiu & Yao use 2..8) so that the shifted "
                f"max exceeds the row max, got {self.tie_shift_beta}; set None to disable the fix."
            )
        if not 0.0 < self.tie_shift_cap <= 80.0:
            raise ValueError(
                f"emulated_fa.tie_shift_cap must be in (0, 80] nats so exp(-cap) stays a normal FP32 "
                f"number, got {self.tie_shift_cap}."
            )


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest BF16 value (ties to even) and return in ``x.dtype``."""
    return x.to(torch.bfloat16).to(x.dtype)


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Spacing of BF16 numbers at ``x``: ``2 ** (floor(log2|x|) - 7)``, elementwise.

    Defined as ``0`` at ``x == 0`` (so a zero output receives no injected bias). For
    subnormal ``|x|`` the spacing is clamped to the BF16 subnormal spacing ``2 ** -133``.
    Inputs are assumed finite. Computed with ``frexp`` (exact, unlike ``log2`` near powers of 2).
    """
    _, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, |mantissa| in [0.5, 1)
    power = (exponent - 1 - BF16_MANTISSA_BITS).clamp_min(BF16_MIN_EXPONENT - BF16_MANTISSA_BITS)
    ulp = torch.ldexp(torch.ones_like(x), power)
    return torch.where(x == 0, torch.zeros_like(x), ulp)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _causal_tile_mask(
    r0: int, r1: int, c0: int, c1: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean [r1-r0, c1-c0] mask, True where key column > query row; None if nothing masked."""
    if c1 - 1 <= r0:
        return None
    rows = torch.arange(r0, r1, device=device)[:, None]
    cols = torch.arange(c0, c1, device=device)[None, :]
    return cols > rows


def _shifted_max(m: torch.Tensor, count: torch.Tensor, cfg: EmulatedFAConfig) -> torch.Tensor:
    """The max to subtract: ``m``, or the (capped) Qiu & Yao shift where the running max is tied."""
    if cfg.tie_shift_beta is None:
        return m
    shifted = torch.where(m > 0, m * cfg.tie_shift_beta, torch.where(m < 0, torch.zeros_like(m), m))
    shifted = torch.minimum(shifted, m + cfg.tie_shift_cap)
    return torch.where(count > 1, shifted, m)


def _p_bar(s: torch.Tensor, m_used: torch.Tensor) -> torch.Tensor:
    """Unnormalised probabilities of one forward tile, ``exp(s - m_used)`` (FP32, before rounding)."""
    return torch.exp(s - m_used[..., None])


def _output_buffer(q_BHND: torch.Tensor, e: int) -> torch.Tensor:
    """Uninitialised O ``[B,H,N,E]``. With ``E == D`` it is laid out as Q (``empty_like``), as it
    always was, so that the strides every later op sees, and hence its results, stay bit for bit."""
    if q_BHND.shape[3] == e:
        return torch.empty_like(q_BHND)
    return q_BHND.new_empty((*q_BHND.shape[:3], e))


def _fa_forward(
    q_BHND: torch.Tensor,
    k_BHMD: torch.Tensor,
    v_BHME: torch.Tensor,
    scale: float,
    causal: bool,
    cfg: EmulatedFAConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled online-softmax forward.

    Returns (O [B,H,N,E], lse [B,H,N], tied [B,H,N], (Q, K, V) as the kernel stores them, i.e.
    BF16-rounded under emulation) so that the backward does not round them again.
    """
    rnd = round_bf16 if cfg.emulate_bf16 else _identity
    qb, kb, vb = rnd(q_BHND), rnd(k_BHMD), rnd(v_BHME)
    n_q, n_k = q_BHND.shape[2], k_BHMD.shape[2]
    out_BHNE = _output_buffer(q_BHND, v_BHME.shape[3])
    lse_BHN = q_BHND.new_empty(q_BHND.shape[:3])
    tied_BHN = torch.empty(q_BHND.shape[:3], dtype=torch.bool, device=q_BHND.device)
    neg_inf = float("-inf")
    for r0 in range(0, n_q, cfg.block_q):
        r1 = min(r0 + cfg.block_q, n_q)
        q_i = qb[:, :, r0:r1]
        m = q_i.new_full(q_i.shape[:3], neg_inf)
        m_used = m.clone()
        count = torch.zeros(q_i.shape[:3], dtype=torch.int64, device=q_i.device)
        l = q_i.new_zeros(q_i.shape[:3])  # noqa: E741 -- FlashAttention's name for the row sum
        acc = q_i.new_zeros((*q_i.shape[:3], vb.shape[3]))  # [B,H,rows,E]
        k_end = r1 if causal else n_k
        for c0 in range(0, k_end, cfg.block_k):
            c1 = min(c0 + cfg.block_k, k_end)
            s = torch.matmul(q_i, kb[:, :, c0:c1].transpose(-1, -2)) * scale
            mask = _causal_tile_mask(r0, r1, c0, c1, s.device) if causal else None
            if mask is not None:
                s = s.masked_fill(mask, neg_inf)
            tile_max = s.amax(dim=-1)
            m_new = torch.maximum(m, tile_max)
            tile_count = (s == m_new[..., None]).sum(dim=-1)
            count = torch.where(tile_max > m, tile_count, count + tile_count)
            m = m_new
            m_used_new = _shifted_max(m, count, cfg)
            alpha = torch.exp(m_used - m_used_new)  # 0 on the first tile (m_used = -inf)
            p_bar = _p_bar(s, m_used_new)
            l = l * alpha + p_bar.sum(dim=-1)  # noqa: E741
            acc = acc * alpha[..., None] + torch.matmul(rnd(p_bar), vb[:, :, c0:c1])
            m_used = m_used_new
        o = acc / l[..., None]
        out_BHNE[:, :, r0:r1] = o if cfg.fp32_o else rnd(o)
        lse_BHN[:, :, r0:r1] = m_used + torch.log(l)
        tied_BHN[:, :, r0:r1] = count > 1
    return out_BHNE, lse_BHN, tied_BHN, (qb, kb, vb)


def _fa_backward(
    saved: tuple[torch.Tensor, ...],
    do_BHNE: torch.Tensor,
    o_used_BHNE: torch.Tensor,
    scale: float,
    causal: bool,
    cfg: EmulatedFAConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled FA-2 backward with P recomputed from the saved logsumexp.

    ``saved`` is (Q, K, V as stored by the forward, lse).
    """
    qb, kb, vb, lse_BHN = saved
    rnd = round_bf16 if cfg.emulate_bf16 else _identity
    dob = rnd(do_BHNE)
    delta_BHN = (dob * o_used_BHNE).sum(dim=-1)
    dq = torch.zeros_like(qb)
    dk = torch.zeros_like(kb)
    dv = torch.zeros_like(vb)
    n_q, n_k = qb.shape[2], kb.shape[2]
    for r0 in range(0, n_q, cfg.block_q):
        r1 = min(r0 + cfg.block_q, n_q)
        q_i, do_i = qb[:, :, r0:r1], dob[:, :, r0:r1]
        lse_i, delta_i = lse_BHN[:, :, r0:r1, None], delta_BHN[:, :, r0:r1, None]
        k_end = r1 if causal else n_k
        for c0 in range(0, k_end, cfg.block_k):
            c1 = min(c0 + cfg.block_k, k_end)
            k_j, v_j = kb[:, :, c0:c1], vb[:, :, c0:c1]
            s = torch.matmul(q_i, k_j.transpose(-1, -2)) * scale
            mask = _causal_tile_mask(r0, r1, c0, c1, s.device) if causal else None
            if mask is not None:
                s = s.masked_fill(mask, float("-inf"))
            p = torch.exp(s - lse_i)
            dv[:, :, c0:c1] += torch.matmul(rnd(p).transpose(-1, -2), do_i)
            dp = torch.matmul(do_i, v_j.transpose(-1, -2))
            ds = rnd(p * (dp - delta_i))
            dq[:, :, r0:r1] += torch.matmul(ds, k_j) * scale
            dk[:, :, c0:c1] += torch.matmul(ds.transpose(-1, -2), q_i) * scale
    return rnd(dq), rnd(dk), rnd(dv)


def _biased_o(o_BHNE: torch.Tensor, tied_BHN: torch.Tensor, fault: FaultConfig) -> torch.Tensor:
    """``O + strength * ulp_bf16(O) * sign(O)``, on all rows or only on tied rows."""
    bias = fault.strength * ulp_bf16(o_BHNE) * torch.sign(o_BHNE)
    if fault.mode == "tied_rows":
        bias = bias * tied_BHN[..., None].to(bias.dtype)
    return o_BHNE + bias


class _EmulatedFlashAttention(torch.autograd.Function):
    """Autograd wrapper: tiled forward, tiled FA-2 backward, optional fault in ``delta``."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, cfg, fault):  # noqa: D102 (see the module docstring)
        o, lse, tied, (qb, kb, vb) = _fa_forward(q, k, v, scale, causal, cfg)
        ctx.save_for_backward(qb, kb, vb, o, lse, tied)
        ctx.scale, ctx.causal, ctx.cfg = scale, causal, cfg
        # The step is read when the forward runs, so every micro-batch of a step agrees.
        suppressed = cfg.tie_shift_beta is not None and fault is not None and fault.mode == "tied_rows"
        ctx.fault = fault if fault is not None and fault.is_active() and not suppressed else None
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        qb, kb, vb, o, lse, tied = ctx.saved_tensors
        o_used = o if ctx.fault is None else _biased_o(o, tied, ctx.fault)
        saved = (qb, kb, vb, lse)
        dq, dk, dv = _fa_backward(saved, do.to(qb.dtype), o_used, ctx.scale, ctx.causal, ctx.cfg)
        return dq, dk, dv, None, None, None, None


def emulated_flash_attention(
    q_BHND: torch.Tensor,
    k_BHMD: torch.Tensor,
    v_BHME: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    config: EmulatedFAConfig | None = None,
    fault: FaultConfig | None = None,
) -> torch.Tensor:
    """Attention ``softmax(q k^T * scale [causal]) v`` through the emulated low-precision FA.

    Args:
        q_BHND: queries [B, H, N, D].
        k_BHMD: keys [B, H, M, D] (repeat GQA groups to H heads first).
        v_BHME: values [B, H, M, E]; ``E`` may differ from ``D`` (multi-head latent attention).
        softmax_scale: score scale; default ``1 / sqrt(D)`` (the query/key head dim).
        causal: causal mask (query i sees keys 0..i); requires ``N == M``.
        config: kernel options; default ``EmulatedFAConfig()`` (BF16 emulation on, 64x64 tiles).
        fault: biased-rounding injector acting in the backward's ``delta`` only; ``None`` = off.

    Returns:
        O [B, H, N, E] in the dtype of ``q_BHND``. Inputs of lower precision than FP32 are
        computed in FP32 and cast back.
    """
    _check_shapes(q_BHND, k_BHMD, v_BHME, causal)
    cfg = config if config is not None else EmulatedFAConfig()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_BHND.shape[3])
    in_dtype = q_BHND.dtype
    work_dtype = in_dtype if in_dtype in (torch.float32, torch.float64) else torch.float32
    q, k, v = (t.to(work_dtype) for t in (q_BHND, k_BHMD, v_BHME))
    out = _EmulatedFlashAttention.apply(q, k, v, float(scale), bool(causal), cfg, fault)
    return out.to(in_dtype)


def _check_shapes(q_BHND: torch.Tensor, k_BHMD: torch.Tensor, v_BHME: torch.Tensor, causal: bool) -> None:
    """ValueError unless q [B,H,N,D], k [B,H,M,D], v [B,H,M,E] (and N == M when causal)."""
    if (q_BHND.dim() != 4 or k_BHMD.dim() != 4 or v_BHME.dim() != 4
            or k_BHMD.shape[:3] != v_BHME.shape[:3] or q_BHND.shape[:2] != k_BHMD.shape[:2]):
        raise ValueError(
            "emulated_flash_attention expects q [B,H,N,D], k [B,H,M,D] and v [B,H,M,E] with the same B "
            f"and H (repeat GQA groups first), got q {tuple(q_BHND.shape)}, k {tuple(k_BHMD.shape)}, "
            f"v {tuple(v_BHME.shape)}."
        )
    if q_BHND.shape[3] != k_BHMD.shape[3]:
        raise ValueError(f"q and k head dims differ: {q_BHND.shape[3]} vs {k_BHMD.shape[3]}.")
    if causal and q_BHND.shape[2] != k_BHMD.shape[2]:
        raise ValueError(
            "causal attention needs equal query and key lengths, "
            f"got {q_BHND.shape[2]} and {k_BHMD.shape[2]}."
        )
