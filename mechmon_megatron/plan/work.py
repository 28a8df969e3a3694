"""Which rank does which monitor work per check, and what each rank holds in snapshots.

The work model of the session (docs/PERFORMANCE.md, "Frontier shapes: mechmon-plan"), for a
global layer ``L`` (1-based) on a pipeline stage (layers split evenly over PP stages):

* per-head work (Delta1/2/3 spectra and per-head dW_q / dW_k spectra): data-parallel rank
  ``(L - 1) % dp``, on each of its TP ranks, for that rank's ``np / tp`` query heads and
  ``ng / tp`` K groups (one group when ``ng < tp``). Snapshot: those Q and K rows.
* full-matrix work (randomized dW_q and dW_k spectra, power-iteration ||W_q||_2): one rank of
  the stage's DP x TP grid, ``j = (L - 1) % (dp * tp)``: dp rank ``j // tp``, tp rank ``j % tp``,
  on the TP-gathered weight. Snapshot: all Q and K rows of the layer; with ``tp == 1`` the rank
  that does the full matrix also does the heads and the two snapshots are one tensor.
* routers (MoE layers): statistics reduced in the forward hook on every rank for its tokens,
  one all-reduce per router; router-weight geometry on one reporting rank per stage
  (dp rank 0, tp rank 0).

Multi-head latent attention (``--multi-latent-attention``) keeps the same ranks, with its own tensors:

* per-head work: ``mla_delta2_singular_values`` for the rank's ``np / tp`` heads, plus the two
  thin QRs of the shared down projections, which every TP rank of the replica computes for itself.
  Snapshot (:func:`mla_snapshot_elements`): ``linear_q_down_proj`` ``[r_q, H]`` whole (replicated
  over TP, or counted whole where Megatron's local spec row-splits it), ``q_layernorm`` gamma,
  the rank's rows of ``linear_q_up_proj`` ``[np/tp * d_qk, r_q]`` (without a query latent:
  ``linear_q_proj`` ``[np/tp * d_qk, H]``), ``linear_kv_down_proj`` ``[r_kv + d_rope, H]``,
  ``kv_layernorm`` gamma and only the key rows of ``linear_kv_up_proj`` ``[np/tp * d_nope, r_kv]``.
* full-matrix work: the dW spectra of the two projections from the hidden state,
  ``linear_q_down_proj`` (or ``linear_q_proj``) and ``linear_kv_down_proj``, on the same owner
  rank. The down projections are replicated, so no TP gather (``linear_q_proj`` is split over TP
  and is gathered), and where that rank also does the layer's per-head work its snapshot already
  holds them (one snapshot, as with ``tp == 1``).

``overlap = ceil(delta / interval)`` snapshot sets are held at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from mechmon_megatron.plan.shapes import LatentDims, ModelShape, ParallelLayout


def mla_snapshot_elements(heads: int, hidden: int, lat: LatentDims) -> dict[str, int]:
    """Elements of each tensor the MLA per-head check reads for ``heads`` query heads of one layer.

    Keys are megatron-core's parameter names; shapes ``[out, in]`` as in the module docstring
    (``H`` = ``hidden``). Value rows of ``linear_kv_up_proj`` are not read (they do not enter
    the attention logits).
    """
    if lat.q_lora_rank is None:
        query = {"linear_q_proj": heads * lat.d_qk * hidden}
    else:
        r_q = lat.q_lora_rank
        query = {"linear_q_down_proj": r_q * hidden, "q_layernorm": r_q, "linear_q_up_proj": heads * lat.d_qk * r_q}
    return {**query, "linear_kv_down_proj": lat.n_kv * hidden, "kv_layernorm": lat.kv_lora_rank,
            "linear_kv_up_proj_key_rows": heads * lat.d_nope * lat.kv_lora_rank}


@dataclass(frozen=True, kw_only=True)
class UnitShapes:
    """The shapes of one unit of each attention component on one rank."""

    heads: int
    """Query heads of a per-head unit (``np / tp``)."""
    groups: int
    """K groups of a per-head unit (``ng / tp``, or 1 when ``ng < tp``; 0 with MLA, which has none)."""
    head_dim: int
    """Query/key head dim (MLA: ``d_nope + d_rope``)."""
    hidden: int
    full_q_rows: int
    """Rows of the full W_q (``np * head_dim``; MLA: ``r_q``, or ``np * d_qk`` without a query latent)."""
    full_k_rows: int
    """Rows of the full W_k (``ng * head_dim``; MLA: ``linear_kv_down_proj``'s ``r_kv + d_rope``)."""
    latent: Optional[LatentDims] = None
    """The MLA sizes; None for classic attention."""

    @property
    def heads_elements(self) -> int:
        """Snapshot elements of one per-head unit (classic: Q rows + K rows of the rank; MLA:
        :func:`mla_snapshot_elements`)."""
        if self.latent is not None:
            return sum(mla_snapshot_elements(self.heads, self.hidden, self.latent).values())
        return (self.heads + self.groups) * self.head_dim * self.hidden

    @property
    def full_elements(self) -> int:
        """Snapshot elements of one full-matrix unit (all Q + K rows of the layer; MLA: the two
        projections from the hidden state)."""
        return (self.full_q_rows + self.full_k_rows) * self.hidden

    def gathered_elements(self, tp: int) -> int:
        """Elements of one full-matrix unit that live on other TP ranks and are gathered (all of it
        for classic attention; with MLA only ``linear_q_proj``: the down projections are replicated)."""
        if tp == 1:
            return 0
        if self.latent is None:
            return self.full_elements
        return self.full_q_rows * self.hidden if self.latent.q_lora_rank is None else 0


def full_inside_heads(shape: ModelShape, layout: ParallelLayout) -> bool:
    """Whether a rank doing a layer's per-head and full-matrix work holds one snapshot for both:
    with ``tp == 1`` (the rank's rows are the whole layer), and with MLA's replicated down
    projections, which the per-head snapshot holds anyway."""
    lat = shape.latent()
    return layout.tp == 1 or (lat is not None and lat.q_lora_rank is not None)


def unit_shapes(shape: ModelShape, layout: ParallelLayout) -> UnitShapes:
    tp, ng = layout.tp, shape.num_query_groups
    lat = shape.latent()
    if lat is not None:
        q_rows = shape.num_attention_heads * lat.d_qk if lat.q_lora_rank is None else lat.q_lora_rank
        return UnitShapes(heads=shape.num_attention_heads // tp, groups=0, head_dim=lat.d_qk,
                          hidden=shape.hidden_size, full_q_rows=q_rows, full_k_rows=lat.n_kv, latent=lat)
    return UnitShapes(
        heads=shape.num_attention_heads // tp,
        groups=ng // tp if ng >= tp else 1,
        head_dim=shape.kv_channels,
        hidden=shape.hidden_size,
        full_q_rows=shape.num_attention_heads * shape.kv_channels,
        full_k_rows=ng * shape.kv_channels,
    )


@dataclass(frozen=True, kw_only=True)
class RankWork:
    """One rank's monitor work per check (counts of units of each component)."""

    head_units: int
    """Layers whose per-head work this rank does."""
    full_units: int
    """Layers whose full-matrix work this rank does."""
    shared_units: int
    """Layers where this rank's per-head snapshot holds its full-matrix one (:func:`full_inside_heads`)."""
    routers: int
    """MoE layers on this rank's stage (hook statistics and one all-reduce each)."""
    reporting_routers: int
    """Routers whose weight geometry this rank computes (the stage's reporting rank)."""

    def snapshot_elements(self, units: UnitShapes, overlap: int) -> int:
        """Elements held in snapshots at once (``overlap`` sets)."""
        per_set = (
            self.head_units * units.heads_elements
            + (self.full_units - self.shared_units) * units.full_elements
        )
        return overlap * per_set


@dataclass(frozen=True, kw_only=True)
class RankClass:
    """Ranks with the same work: one example rank and how many there are."""

    work: RankWork
    count: int
    example: tuple[int, int, int]
    """``(pp_rank, dp_rank, tp_rank)`` of the first such rank."""


def rank_work(shape: ModelShape, layout: ParallelLayout, pp_rank: int, dp_rank: int, tp_rank: int) -> RankWork:
    """Work of the rank at ``(pp_rank, dp_rank, tp_rank)``."""
    tp, dp = layout.tp, layout.dp
    per_stage = shape.num_layers // layout.pp
    layers = range(pp_rank * per_stage + 1, (pp_rank + 1) * per_stage + 1)
    heads = [L for L in layers if (L - 1) % dp == dp_rank]
    full = [L for L in layers if (L - 1) % (dp * tp) == dp_rank * tp + tp_rank]
    shared = len(set(heads) & set(full)) if full_inside_heads(shape, layout) else 0
    routers = sum(1 for L in layers if shape.is_moe_layer(L))
    reporting = routers if (dp_rank == 0 and tp_rank == 0) else 0
    return RankWork(head_units=len(heads), full_units=len(full), shared_units=shared, routers=routers,
                    reporting_routers=reporting)


def rank_classes(shape: ModelShape, layout: ParallelLayout) -> list[RankClass]:
    """Every rank's work, grouped into classes of identical work (most loaded first is not
    implied: order is by first occurrence, pp then dp then tp)."""
    counts: Counter = Counter()
    examples: dict[RankWork, tuple[int, int, int]] = {}
    for p in range(layout.pp):
        for d in range(layout.dp):
            for t in range(layout.tp):
                work = rank_work(shape, layout, p, d, t)
                counts[work] += 1
                examples.setdefault(work, (p, d, t))
    return [RankClass(work=w, count=counts[w], example=examples[w]) for w in examples]


def router_tokens_per_micro_batch(shape: ModelShape, layout: ParallelLayout) -> int:
    """Tokens one rank routes per micro-batch (sequence parallel splits them over TP)."""
    tokens = shape.micro_batch_size * shape.seq_length
    return max(1, tokens // layout.tp) if layout.sequence_parallel else tokens


def micro_batches_per_step(shape: ModelShape, layout: ParallelLayout) -> int:
    return shape.global_batch_size // (layout.dp * shape.micro_batch_size)
