"""Read a tensor-parallel row shard and gather the shards, without leaving peers waiting."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from mechmon_megatron.session.collective_guard import CollectiveGuard


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def read_and_gather_rows(read: Callable[[], torch.Tensor], group: Any, what: str,
                         guard: CollectiveGuard) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local, gathered)``: the rank's row shard and the TP shards concatenated (no autograd).

    Every rank of ``group`` enters the all-gather only after all of them read their shard and
    prepared their buffers; a local failure (an out-of-memory error) raises on every rank
    instead of leaving the others waiting in the collective. Both run through ``guard``.
    """
    size = group_size(group)

    def prepare() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        local = read()
        return local, local.contiguous(), [torch.empty_like(local) for _ in range(size)]

    def gather(prepared: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        local, own, parts = prepared
        guard.all_gather(parts, own, group, f"the tensor-parallel gather of {what}")
        return local, torch.cat(parts, dim=0)

    return guard.guarded(prepare, gather, group, what)
