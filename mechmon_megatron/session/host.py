"""What a host adapter hands the session: monitored sites and a communicator.

A host adapter (megatron-core, Megatron-LM, DeepSpeed, ...) maps its modules onto these small
records. The session never looks at host modules itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch


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


@dataclass
class RouterSite:
    """One MoE router as seen from one rank.

    ``weight`` returns the router weight ``[num_experts, hidden]`` (replicated). ``reduce_sum``
    all-reduces a flat fp64 vector over the ranks that route distinct tokens through this router
    (data parallel, plus tensor parallel under sequence parallelism); every rank listing the site
    calls it. ``reports`` is True on exactly one of those ranks.
    """

    layer_number: int
    num_experts: int
    topk: int
    weight: Callable[[], torch.Tensor]
    reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    reports: bool
    name: str = ""
    captured_logits: list = field(default_factory=list)
    """Filled by the adapter's capture hook on check steps: tensors ``[..., num_experts]``."""


class Communicator(Protocol):
    """Collectives the session needs across the whole job (every rank calls each, same order)."""

    is_writer: bool

    def gather_to_writer(self, obj: Any) -> Optional[list]:
        """Gather one picklable object per rank on the writer rank (None elsewhere)."""

    def broadcast_flag(self, flag: int) -> int:
        """Return the writer's integer ``flag`` on every rank (one small tensor broadcast)."""


class LocalCommunicator:
    """Single process: this rank is the writer."""

    is_writer = True

    def gather_to_writer(self, obj: Any) -> Optional[list]:
        return [obj]

    def broadcast_flag(self, flag: int) -> int:
        return int(flag)


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

    def broadcast_flag(self, flag: int) -> int:
        box = torch.tensor([int(flag)], dtype=torch.int64, device=self._device)
        self._dist.broadcast(box, src=self._global_writer(), group=self._group)
        return int(box.item())
