"""mechmon's state inside a megatron-core distributed checkpoint: one ``ShardedObject`` per rank.

Every rank's ``session.state_dict()`` (small: detector baselines on the writer rank, the error
count and the checkpoint list on every rank) is one shard of the entry :data:`STATE_KEY`
(``"mechmon"``) of the sharded state dict the host passes to ``dist_checkpointing.save``:
global shape ``(world_size,)``, offset ``(rank,)``, ``replica_id`` 0, so each rank writes its own
shard (as Megatron-LM stores ``rng_state`` under expert parallelism). The example trainer and the
Megatron-LM adapter (``--ckpt-format torch_dist``) both use it.

On load the template may only name the entry when the checkpoint has it (``dist_checkpointing.load``
fails on a key the checkpoint lacks): :func:`add_load_template` reads the checkpoint's metadata
first, so older checkpoints without it load, and the caller falls back to the older layouts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional

import torch

from mechmon_megatron.session.log import mechmon_log
from mechmon_megatron.session.state_format import STATE_KEY, state_of

__all__ = ["add_load_template", "loaded_state", "rank_and_world", "saved_world", "state_shard"]

log = mechmon_log(__name__)


def rank_and_world() -> tuple[int, int]:
    """(global rank, world size); (0, 1) without a process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def state_shard(state: Mapping[str, Any], rank: Optional[int] = None, world: Optional[int] = None) -> Any:
    """This rank's ``state`` as its shard of the ``mechmon`` entry (a megatron-core ``ShardedObject``).

    The state is deep-copied: an asynchronous save (``--async-save``) serialises it after the
    next checks have already changed the live detector.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    here, size = rank_and_world()
    rank, world = here if rank is None else rank, size if world is None else world
    return ShardedObject(STATE_KEY, copy.deepcopy(dict(state)), (world,), (rank,), replica_id=0)


def saved_world(checkpoint_dir: str) -> Optional[int]:
    """The world size the checkpoint's ``mechmon`` entry was saved with; None when it has none.

    Reads the checkpoint's metadata only (``dist_checkpointing.serialization.load_sharded_metadata``).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    for item in load_sharded_metadata(checkpoint_dir).values():
        if isinstance(item, ShardedObject) and item.key == STATE_KEY:
            return int(item.global_shape[0])
    return None


def add_load_template(template: MutableMapping[str, Any], checkpoint_dir: str) -> bool:
    """Name this rank's shard of ``mechmon`` in the load template when the checkpoint holds the
    entry for this world size; True when added. A checkpoint saved by another number of ranks
    is not resharded (the per-rank states do not map): the detectors start with a fresh baseline."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world_then = saved_world(checkpoint_dir)
    if world_then is None:
        return False
    rank, world = rank_and_world()
    if world_then != world:
        log.warning("%s holds mechmon state of %d ranks, this job has %d: not restored, the detectors start with "
                    "a fresh baseline", checkpoint_dir, world_then, world, rank=0)
        return False
    template[STATE_KEY] = ShardedObject(STATE_KEY, None, (world,), (rank,), replica_id=0)
    return True


def loaded_state(loaded: Mapping[str, Any], where: str) -> Optional[dict]:
    """This rank's state from what ``dist_checkpointing.load`` returned (None when absent)."""
    return state_of({STATE_KEY: loaded.get(STATE_KEY)}, where)
