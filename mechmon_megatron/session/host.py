"""What a host adapter hands the session: monitored sites and a communicator.

A host adapter (megatron-core, Megatron-LM, DeepSpeed, ...) maps its modules onto these small
records. The session never looks at host modules itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from mechmon_megatron.monitors.router import summarize_routing

logger = logging.getLogger(__name__)


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


@dataclass
class FullQK:
    """The whole layer's Q and K weights (all heads, TP shards gathered).

    wq: ``[num_attention_heads * head_dim, hidden]``; wk: ``[num_query_groups * head_dim, hidden]``.
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
    read_heads: Callable[[], Optional[QKWeights]]
    read_full: Callable[[], Optional[FullQK]]
    name: str = ""
    snapshot_budget: Optional[SnapshotBudget] = None
    """For the start-up memory log and the snapshot placement (None: unknown until read)."""


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


class Communicator(Protocol):
    """Collectives the session needs across the whole job (every rank calls each, same order)."""

    is_writer: bool
    rank: int

    def gather_to_writer(self, obj: Any) -> Optional[list]:
        """Gather one picklable object per rank on the writer rank (None elsewhere)."""

    def broadcast_from_writer(self, obj: Any) -> Any:
        """Return the writer's picklable ``obj`` on every rank (the decision of a check)."""


class LocalCommunicator:
    """Single process: this rank is the writer."""

    is_writer = True
    rank = 0

    def gather_to_writer(self, obj: Any) -> Optional[list]:
        return [obj]

    def broadcast_from_writer(self, obj: Any) -> Any:
        return obj


class TorchDistributedCommunicator:
    """torch.distributed over a process group (default: WORLD); writer = a given global rank.

    Megatron-LM's TensorBoard writer lives on the last rank, hence the default ``writer_rank=-1``.
    """

    def __init__(self, group: Any = None, writer_rank: int = -1, device: Optional[torch.device] = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        # NCCL collectives need a CUDA tensor; gloo a CPU one.
        if device is None:
            backend = dist.get_backend(group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._device = device
        self._group = group
        world = dist.get_world_size(group)
        self.writer_rank = writer_rank % world
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.is_writer = self.rank == self.writer_rank
        self._world = world

    def _global_writer(self) -> int:
        if self._group is None:
            return self.writer_rank
        return self._dist.get_global_rank(self._group, self.writer_rank)

    def gather_to_writer(self, obj: Any) -> Optional[list]:
        out = [None] * self._world if self.is_writer else None
        self._dist.gather_object(obj, out, dst=self._global_writer(), group=self._group)
        return out

    def broadcast_from_writer(self, obj: Any) -> Any:
        box = [obj if self.is_writer else None]
        self._dist.broadcast_object_list(box, src=self._global_writer(), group=self._group, device=self._device)
        return box[0]
