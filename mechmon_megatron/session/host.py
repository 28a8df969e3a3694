"""What a host adapter hands the session: monitored sites and a communicator.

A host adapter (megatron-core, Megatron-LM, DeepSpeed, ...) maps its modules onto these small
records. The session never looks at host modules itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from mechmon_megatron.detect.phase_moments import STANDARD_ATTENTION
from mechmon_megatron.monitors.mla_increment import MLAWeights
from mechmon_megatron.monitors.norm_fold import NormFold
from mechmon_megatron.monitors.router import summarize_routing
from mechmon_megatron.session import collective_guard, payload_codec
from mechmon_megatron.session.records import Verdict


@dataclass
class QKWeights:
    """Per-head Q and K projection rows, Megatron row layout.

    wq: ``[num_heads, head_dim, hidden]`` -- the heads this rank reports (global indices
        ``head_offset .. head_offset + num_heads - 1``).
    wk: ``[num_groups, head_dim, hidden]`` -- the K groups those heads use; query head i uses
        group ``i // (num_heads // num_groups)``.
    """

    wq: torch.Tensor
    wk: torch.Tensor
    head_offset: int = 0
    q_norm: Optional[NormFold] = None
    """The per-head norm on the queries (``qk_layernorm``), folded into ``wq`` by the check."""
    k_norm: Optional[NormFold] = None
    """The per-head norm on the keys, folded into ``wk`` by the check."""


@dataclass
class MLAHeads:
    """The query/key weights of one multi-head latent attention layer for the heads this rank reports.

    ``weights``: the layer's down projections and latent gammas (whole) and the up-projection
    rows of heads ``head_offset .. head_offset + num_heads - 1`` (``linear_kv_up_proj``: key rows
    only, i.e. ``d_v = 0`` in :class:`~mechmon_megatron.monitors.mla_increment.MLAWeights`);
    ``d_nope`` / ``d_rope``: no-RoPE and RoPE query/key head dims.
    """

    weights: MLAWeights
    d_nope: int
    d_rope: int
    num_heads: int
    head_offset: int = 0


@dataclass
class FullQK:
    """The whole layer's Q and K weights (all heads, TP shards gathered).

    wq: ``[num_attention_heads * head_dim, hidden]``; wk: ``[num_query_groups * head_dim, hidden]``.
    For an MLA layer: the two projections from the hidden state, ``linear_q_down_proj`` (or
    ``linear_q_proj``) and ``linear_kv_down_proj``.
    """

    wq: torch.Tensor
    wk: torch.Tensor


@dataclass(frozen=True)
class SnapshotBudget:
    """What one site's snapshot holds on this rank, known from shapes alone (no read).

    ``heads_elements``: the per-head Q + K rows this rank reports (0: none); ``full_elements``:
    the whole layer's Q + K rows on the full-matrix owner (0: not the owner); ``shared``: both are
    the same rows (one owner with tensor parallel size 1), so one copy serves both;
    ``element_size``: bytes per element as read (4 for FP32 main parameters); ``device``: where
    the weights live.
    """

    heads_elements: int
    full_elements: int
    shared: bool
    element_size: int
    device: torch.device

    def nbytes(self, full_matrix: bool) -> int:
        full = self.full_elements if full_matrix else 0
        elements = max(self.heads_elements, full) if self.shared and full else self.heads_elements + full
        return elements * self.element_size


@dataclass
class AttentionSite:
    """One attention layer as seen from one rank.

    ``read_heads`` returns the heads this rank reports (None when it reports none, e.g. a
    data-parallel replica). ``read_full`` returns the full gathered matrices on the owning rank and
    None elsewhere; it may run a collective, so EVERY rank that lists the site must call it, in
    site order.
    """

    layer_number: int
    read_heads: Callable[[], Optional[QKWeights | MLAHeads]]
    read_full: Callable[[], Optional[FullQK]]
    name: str = ""
    snapshot_budget: Optional[SnapshotBudget] = None
    """For the start-up memory log and the snapshot placement (None: unknown until read)."""
    reports: Optional[bool] = None
    """Whether this rank does the layer's per-head or full-matrix work (sends records at a check);
    None: unknown (from ``snapshot_budget``, or assumed)."""
    attention: str = STANDARD_ATTENTION
    """``standard`` (multi-head, grouped-query) or ``mla`` (multi-head latent attention, whose
    Delta2 stream is the content part): the early-phase correction holds for the kind it was
    measured on (``detect.phase_moments``)."""


@dataclass
class RouterSite:
    """One MoE router as seen from one rank.

    ``weight`` returns the router weight ``[num_experts, hidden]`` (replicated). ``reduce_sum``
    all-reduces a flat fp64 vector over the ranks that route distinct tokens through this router
    (data parallel, plus tensor parallel under sequence parallelism); every rank listing the site
    calls it. ``reports`` is True on exactly one of those ranks.

    On check steps the adapter's hook passes each micro-batch's logits, and the router's own
    routing map where the host exposes it, to :meth:`capture`, which reduces them at once to a
    flat fp64 summary (entropy sum, entropy histogram, expert counts) added into ``summary`` on
    the logits' device: no logits are kept and nothing is read back to the host during the
    forward.
    """

    layer_number: int
    num_experts: int
    topk: int
    weight: Callable[[], torch.Tensor]
    reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    reports: bool
    name: str = ""
    num_bins: int = 512
    """Entropy histogram bins (set by the session from ``--mechmon-router-entropy-bins``)."""
    summary: Optional[torch.Tensor] = None
    """Running flat summary of this check step's micro-batches (``RouterEntropySummary`` layout)."""
    micro_batches: int = 0
    capture_error: Optional[BaseException] = None
    """The first exception raised while summarising (reported by the session at the check)."""
    score_function: str = "softmax"
    """The router's score function (``monitors.router.SCORE_FUNCTIONS``): defines the entropy."""
    drops_tokens: bool = False
    """The router drops assignments beyond an expert capacity (the check reports the dropped share)."""

    def capture(self, logits: torch.Tensor, routing_map: Optional[torch.Tensor] = None,
                token_mask: Optional[torch.Tensor] = None) -> None:
        """Add one micro-batch's router logits ``[..., num_experts]`` to the running summary.

        ``routing_map``: the router's actual bool assignment (one row per token; after an expert
        bias, group-limited selection, capacity dropping); without it the expert counts are the
        top-k of the logits. ``token_mask``: one entry per token, zero for a token that does not
        count (``summarize_routing``). Runs inside the host's forward: it never raises (a failure is kept
        for the check, which counts it) and never synchronises with the host.
        """
        if self.capture_error is not None:
            return
        try:
            routed = None if routing_map is None else routing_map.detach()
            flat = summarize_routing(logits.detach(), self.topk, num_bins=self.num_bins, routing_map=routed,
                                     score_function=self.score_function, token_mask=token_mask).to_flat_tensor()
            self.summary = flat if self.summary is None else self.summary + flat
            self.micro_batches += 1
        except Exception as exc:  # noqa: BLE001 -- never kill the training forward
            self.capture_error = exc

    def take_summary(self) -> tuple[Optional[torch.Tensor], Optional[BaseException]]:
        """This step's summary and capture error; resets both for the next check step."""
        out = (self.summary, self.capture_error)
        self.summary, self.capture_error, self.micro_batches = None, None, 0
        return out


REPORTING = "reporting"
"""mechmon's group of the ranks that send records at a check (and the writer)."""


class Communicator(Protocol):
    """Collectives the session needs across the whole job (every rank calls each, same order,
    except :meth:`gather_reports`, which only the reporting ranks and the writer call).
    ``guard``: the process's :class:`~mechmon_megatron.session.collective_guard.CollectiveGuard`,
    which every collective runs through (the session uses the same one)."""

    is_writer: bool
    rank: int
    guard: collective_guard.CollectiveGuard

    def set_reporting(self, reports: bool) -> None:
        """Start-up, before the session makes its groups: whether this rank sends records at checks."""

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """The sum of ``values`` (a few numbers, the same count on every rank) over every rank."""

    def gather_reports(self, payload: Any) -> Optional[list]:
        """The reporting ranks' payloads on the writer (None elsewhere); reporting ranks only."""

    def gather_to_writer(self, obj: Any) -> Optional[list]:
        """Gather one picklable object per rank on the writer rank (None elsewhere)."""

    def broadcast_verdict(self, verdict: Optional[Verdict]) -> Verdict:
        """The writer's verdict on every rank: one small tensor, plus its objects only when it
        carries any (an alarm's alerts, a strict stop)."""

    def agree_startup(self, choice: int, problems: Sequence[Optional[str]]) -> tuple[int, Optional[tuple[int, str]]]:
        """Start-up, every rank: the job's choice (the largest ``choice`` of any rank) and ``(rank,
        its problem)`` of the lowest rank with a problem under that choice (``problems[c]``: this
        rank's problem if the job chose ``c``; None: none), the same on every rank."""


def process_guard(guard: Optional[collective_guard.CollectiveGuard]) -> collective_guard.CollectiveGuard:
    """``guard``, or this process's (``collective_guard.guard()``): a communicator built without one
    (a test, a tool) uses the process's, as every host's does."""
    return guard if guard is not None else collective_guard.guard()


class LocalCommunicator:
    """Single process: this rank is the writer."""

    is_writer = True
    rank = 0

    def __init__(self, guard: Optional[collective_guard.CollectiveGuard] = None) -> None:
        self.guard = process_guard(guard)

    def set_reporting(self, reports: bool) -> None:
        return None

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def gather_reports(self, payload: Any) -> Optional[list]:
        return [payload]

    def gather_to_writer(self, obj: Any) -> Optional[list]:
        return [obj]

    def broadcast_verdict(self, verdict: Optional[Verdict]) -> Verdict:
        assert verdict is not None  # the one rank is the writer
        return verdict

    def agree_startup(self, choice: int, problems: Sequence[Optional[str]]) -> tuple[int, Optional[tuple[int, str]]]:
        problem = problems[choice]
        return choice, (None if problem is None else (0, problem))


@dataclass
class _SchemaCache:
    """What one records path remembers between checks: the schema this rank sent last, and on
    the writer each reporting rank's (by global rank)."""

    sent: Optional[tuple] = None
    received: dict[int, tuple] = field(default_factory=dict)


class TorchDistributedCommunicator:
    """torch.distributed over a process group (default: WORLD); writer = a given global rank.

    Megatron-LM's TensorBoard writer lives on the last rank, hence the default ``writer_rank=-1``.
    Every collective runs through ``guard`` (default: this process's
    :class:`~mechmon_megatron.session.collective_guard.CollectiveGuard`), on mechmon's own copy of
    ``group``, bounded by ``--mechmon-collective-timeout``.

    ``owner_group``: the host group whose reporting ranks first send their records to one owner
    (the tensor-parallel group: :meth:`gather_reports` in two levels); None: every reporting rank
    sends straight to the writer (one level; DeepSpeed, which has no tensor parallelism).
    """

    def __init__(self, group: Any = None, writer_rank: int = -1, device: Optional[torch.device] = None,
                 owner_group: Any = None, guard: Optional[collective_guard.CollectiveGuard] = None) -> None:
        import torch.distributed as dist

        self.guard = process_guard(guard)
        self.guard.declare(group)
        self._group = group
        world = dist.get_world_size(group)
        self.writer_rank = writer_rank % world
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.is_writer = self.rank == self.writer_rank
        self._world = world
        self._global_writer = writer_rank % world if group is None else dist.get_global_rank(group, self.writer_rank)
        self.reports = True
        self._owner_ranks: Optional[tuple[int, ...]] = (
            None if owner_group is None else tuple(dist.get_process_group_ranks(owner_group)))
        self._direct = _SchemaCache()  # one level: straight to the writer
        self._tiered = _SchemaCache()  # two levels: to the owner, then owners to the writer

    @property
    def two_level(self) -> bool:
        """Whether :meth:`gather_reports` goes through the owners of the owner groups."""
        return self._owner_ranks is not None

    def set_reporting(self, reports: bool) -> None:
        self.reports = bool(reports) or self.is_writer
        self.guard.declare_member(REPORTING, self.reports, part=self._owner_ranks, leader=self._global_writer)

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        work = torch.tensor([float(v) for v in values], dtype=torch.float64,
                            device=collective_guard.group_device(self._group))
        self.guard.all_reduce(work, self._group, "the check's failure and error counts")
        return [float(v) for v in work.tolist()]

    def gather_reports(self, payload: Any) -> Optional[list]:
        """The reporting ranks' payloads on the writer, in global rank order (None elsewhere).

        Two levels with an owner group (:meth:`gather_tiered`), else one (:meth:`gather_direct`);
        both decode to the same list."""
        return self.gather_tiered(payload) if self.two_level else self.gather_direct(payload)

    def gather_direct(self, payload: Any) -> Optional[list]:
        """One level: every reporting rank's row straight to the writer (``session/payload_codec.py``):

        1. one all-reduce (MAX) over the reporting ranks: the longest row, and whether any rank
           has objects to send (a changed schema, a non-finite report, a stream beyond its limit);
        2. one tensor gather of every reporting rank's float64 row ``[n, has_objects, values, pad]``;
        3. only when some rank has objects: one object gather of them.
        """
        members = self.guard.members(REPORTING)
        what = "the reporting ranks' records to the writer"
        values, objects = self._encode(payload, self._direct)
        got = _gather_rows(self.guard, values, objects, members, self._global_writer, what)
        if got is None:
            return None
        rows, sent = got
        return sorted((self._decode(rank, row, extra, self._direct) for rank, row, extra in
                       zip(members.ranks, rows, sent)), key=lambda p: p.rank)

    def gather_tiered(self, payload: Any) -> Optional[list]:
        """Two levels: each owner group's reporting ranks to its owner, then the owners to the writer.

        Level 1, over the reporting ranks of this rank's owner group (its tensor-parallel group),
        to their owner (the writer where it is one of them, else the lowest): the exchange of
        :meth:`gather_direct`. The owner concatenates its members' numbers into one row of a fixed
        layout ``[members, 1 + W, (n, values, pad to W) per member]`` (``W``: the longest member's
        count). Level 2, over the owners, to the writer: the same exchange with those rows, objects
        (each member's, in member order) only when some member had any. The writer splits each
        owner's row by member. Every rank then waits on at most its own owner group and the owners."""
        tiers = self.guard.tiers(REPORTING)
        values, objects = self._encode(payload, self._tiered)
        what = "the reporting ranks' records to their owner"
        first = _gather_rows(self.guard, values, objects, tiers.part, tiers.leader, what)
        if first is None:
            return None
        rows, sent = first
        width = max((len(r) for r in rows), default=0)
        merged = [float(len(rows)), float(1 + width)]
        for r in rows:
            merged += [float(len(r)), *r] + [0.0] * (width - len(r))
        carried = sent if any(sent) else None
        second = _gather_rows(self.guard, merged, carried, tiers.leaders, self._global_writer,
                              "the owners' records to the writer")
        if second is None:
            return None
        out = []
        for leader, owner_row, owner_objects in zip(tiers.leaders.ranks, *second):
            part = tiers.part_of(leader)
            count, width = int(owner_row[0]), int(owner_row[1])
            if count != len(part.ranks):
                raise ValueError(f"mechmon: the owner rank {leader} forwarded {count} members' records, its group "
                                 f"has {len(part.ranks)}")
            extras = owner_objects or [None] * count
            for index, rank in enumerate(part.ranks):
                block = owner_row[2 + index * width : 2 + (index + 1) * width]
                block = block[1 : 1 + int(block[0])]
                out.append(self._decode(rank, block, extras[index], self._tiered))
        return sorted(out, key=lambda p: p.rank)

    @staticmethod
    def _encode(payload: Any, cache: _SchemaCache) -> tuple[list[float], Optional[dict]]:
        """This rank's numbers and its objects (None when it has none: schema unchanged, no alarm)."""
        schema, values, extras = payload_codec.encode(payload)
        changed = schema != cache.sent
        objects = {"schema": schema, **extras} if changed else extras
        cache.sent = schema
        return values, (objects or None)

    @staticmethod
    def _decode(rank: int, values: list[float], extra: Optional[dict], cache: _SchemaCache) -> Any:
        """The payload of global rank ``rank`` from its numbers and objects (the writer's)."""
        extra = extra or {}
        if "schema" in extra:
            cache.received[rank] = extra["schema"]
        return payload_codec.decode(cache.received[rank], values, extra)

    def gather_to_writer(self, obj: Any) -> Optional[list]:
        return self.guard.gather_objects(obj, self.writer_rank, self._group, "the failure records to the writer")

    def broadcast_verdict(self, verdict: Optional[Verdict]) -> Verdict:
        mine = verdict if self.is_writer else None
        head = [int(mine.alarm), int(mine.carries_objects)] if mine is not None else [0, 0]
        flag = torch.tensor(head, dtype=torch.int64, device=collective_guard.group_device(self._group))
        self.guard.broadcast(flag, self.writer_rank, self._group, "the writer's decision")
        alarm, carries = (bool(v) for v in flag.tolist())
        if not carries:
            return Verdict(alarm=alarm)
        alerts, stop = self.guard.broadcast_object(
            (verdict.alerts, verdict.stop) if (self.is_writer and verdict is not None) else None,
            self.writer_rank, self._group, "the alarm's alert records")
        return Verdict(alarm=alarm, alerts=list(alerts), stop=stop)

    def agree_startup(self, choice: int, problems: Sequence[Optional[str]]) -> tuple[int, Optional[tuple[int, str]]]:
        """One int64 all-reduce (MIN) of ``[-choice, first problem rank under choice c for every c]``:
        the negated choice makes the MIN a MAX (the job takes the largest); the lowest rank with a
        problem under that choice then broadcasts its message, so every rank raises the same one."""
        flag = torch.tensor([-int(choice), *(self.rank if p is not None else self._world for p in problems)],
                            dtype=torch.int64, device=collective_guard.group_device(self._group))
        self.guard.all_reduce(flag, self._group, "the start-up agreement", op=_min_op())
        agreed = -int(flag[0].item())
        first = int(flag[1 + agreed].item())
        if first >= self._world:
            return agreed, None
        message = self.guard.broadcast_object(problems[agreed], first, self._group, "the start-up refusal")
        return agreed, (first, str(message))


def _gather_rows(guard: collective_guard.CollectiveGuard, values: list[float], objects: Optional[Any],
                 group: collective_guard.Members, dst: int, what: str) -> Optional[tuple[list[list[float]], list]]:
    """Every rank of ``group``'s numbers (counts may differ) and objects on its global rank ``dst``.

    1. one all-reduce (MAX) over ``group``: ``[longest count W, any rank has objects]`` (two float64);
    2. one gather of every rank's float64 row ``[n, has_objects, values, pad]`` (``2 + W`` numbers);
    3. only when some rank has objects: one object gather of them.

    On ``dst``: every rank's numbers (cut to its own ``n``) and objects (None where it had none),
    in ``group`` order; None elsewhere.
    """
    root = group.ranks.index(dst)
    device = collective_guard.group_device(None)
    head = torch.tensor([len(values), 1 if objects is not None else 0], dtype=torch.float64, device=device)
    guard.all_reduce(head, group, what, op=_max_op())
    width, any_objects = int(head[0].item()), bool(head[1].item())
    row = torch.zeros(2 + width, dtype=torch.float64)
    row[0], row[1] = len(values), 1 if objects is not None else 0
    row[2 : 2 + len(values)] = torch.tensor(values, dtype=torch.float64)
    rows = guard.gather(row.to(device), root, group, what)
    sent = guard.gather_objects(objects, root, group, what) if any_objects else None
    if rows is None:
        return None
    cut = [r.cpu()[2 : 2 + int(r[0].item())].tolist() for r in rows]
    return cut, (list(sent) if sent is not None else [None] * len(cut))


def _min_op() -> Any:
    import torch.distributed as dist

    return dist.ReduceOp.MIN


def _max_op() -> Any:
    import torch.distributed as dist

    return dist.ReduceOp.MAX
