"""Read one rank's mechmon state straight out of a torch_dist checkpoint (tests only).

megatron-core stores a ``ShardedObject`` as one bytes item of the PyTorch distributed checkpoint,
named ``KEY/shard_OFFSET_SHAPE`` and holding ``torch.save([data])``; reading it with PyTorch's own
reader (no process group, no megatron-core load) shows the state is inside the checkpoint itself.
"""

from __future__ import annotations

import io
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp


def shard_keys(checkpoint_dir: str) -> list[str]:
    """The ``mechmon/shard_R_W`` items of the checkpoint's metadata."""
    metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    return sorted(key for key in metadata.state_dict_metadata if key.startswith("mechmon/"))


def saved_state(checkpoint_dir: str, rank: int, world: int) -> Optional[dict]:
    """Rank ``rank``'s state of the ``mechmon`` entry (None when the checkpoint has none)."""
    key = f"mechmon/shard_{rank}_{world}"
    if key not in shard_keys(checkpoint_dir):
        return None
    box = {key: io.BytesIO()}
    dcp.load(box, storage_reader=dcp.FileSystemReader(checkpoint_dir), no_dist=True)
    data = box[key]  # PyTorch's default planner unpickles bytes items itself
    if isinstance(data, io.BytesIO):
        data.seek(0)
        data = torch.load(data, weights_only=False)
    (state,) = data
    return state
