"""Make parameters current before the session reads them.

With Megatron's distributed optimizer and ``overlap_param_gather``, updated parameter shards are
all-gathered lazily in the next forward's pre-hooks, so right after ``optimizer.step()`` a rank's
full parameters are stale. On steps where the session reads weights we force the gather.
"""

from __future__ import annotations

from typing import Sequence

import torch


def overlaps_param_gather(model_chunks: Sequence[torch.nn.Module]) -> bool:
    """True when any DDP chunk defers its parameter all-gather to the next forward."""
    return any(bool(getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False)) for c in model_chunks)


def force_param_sync(model_chunks: Sequence[torch.nn.Module]) -> int:
    """All-gather parameters now (distributed optimizer with overlapped param gather).

    Feature-detected: chunks without ``start_param_sync`` (FSDP, plain modules) are skipped.
    Returns the number of chunks synced.
    """
    synced = 0
    for chunk in model_chunks:
        start = getattr(chunk, "start_param_sync", None)
        if callable(start):
            start(force_sync=True)
            synced += 1
    return synced
