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

``overlap = ceil(delta / interval)`` snapshot sets are held at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mechmon_megatron.plan.shapes import ModelShape, ParallelLayout


@dataclass(frozen=True, kw_only=True)
class UnitShapes:
    """The shapes of one unit of each attention component on one rank."""

    heads: int
    """Query heads of a per-head unit (``np / tp``)."""
    groups: int
    """K groups of a per-head unit (``ng / tp``, or 1 when ``ng < tp``)."""
    head_dim: int
    hidden: int
    full_q_rows: int
    """Rows of the full W_q (``np * head_dim``)."""
    full_k_rows: int
    """Rows of the full W_k (``ng * head_dim``)."""

    @property
    def heads_elements(self) -> int:
        """Snapshot elements of one per-head unit (Q rows + K rows of the rank)."""
        return (self.heads + self.groups) * self.head_dim * self.hidden

    @property
    def full_elements(self) -> int:
        """Snapshot elements of one full-matrix unit (all Q + K rows of the layer)."""
        return (self.full_q_rows + self.full_k_rows) * self.hidden


def unit_shapes(shape: ModelShape, layout: ParallelLayout) -> UnitShapes:
    tp, ng = layout.tp, shape.num_query_groups
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
    """Layers where this rank's per-head and full snapshots are one tensor (tp == 1)."""
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
    shared = len(set(heads) & set(full)) if tp == 1 else 0
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
