"""Checkpoints: megatron-core distributed checkpointing plus a per-rank extra-state file.

Layout (like Megatron-LM's)::

    SAVE/latest_checkpointed_iteration.txt      # "7": the last complete checkpoint
    SAVE/iter_0000007/                         # dist_checkpointing.save(model + optimizer
                                               #   + the monitors' state under "mechmon")
    SAVE/iter_0000007/mechmon_extra/rank_00000.pt  # iteration, LR scheduler, RNG, callbacks

The model and optimizer are saved as sharded state dicts (``model.sharded_state_dict()``,
``optimizer.sharded_state_dict(model_sd)``), so they can be loaded with another TP/PP layout.
The monitoring session's state is one ``ShardedObject`` per rank under ``mechmon`` in the same
distributed checkpoint (mechmon's one format, ``mechmon_megatron/session/state_format.py``);
checkpoints of older trainers, with it in the extra file, still load (one notice; the reader of
that older layout is ``state_format.trainer_extra_state``).
The extra state is per rank (RNG states differ per rank); when the world size changed between
save and load, rank 0's file is used and the RNG states are not restored (a warning says so).
The tracker file is written last, so an interrupted save never becomes "latest".

megatron-core's ``torch_dist`` writer measures its process memory with ``psutil`` (debug logging
only) and raises without it; when ``psutil`` is missing we report 0 bytes instead
(:func:`_tolerate_missing_psutil`). Install ``psutil`` to get the real numbers.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel

from mechmon_megatron.adapters.megatron_core.sharded_state import add_load_template, loaded_state, state_shard
from mechmon_megatron.session.state_format import STATE_KEY, trainer_extra_state

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
EXTRA_DIR = "mechmon_extra"
EXTRA_VERSION = 1


def _tolerate_missing_psutil() -> None:
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "HAVE_PSUTIL", True) or not hasattr(filesystem_async,
                                                                      "_process_memory"):
        return
    logger.warning("psutil is not installed: dist_checkpointing memory logging reports 0")
    filesystem_async._process_memory = lambda: 0


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return int(f.read().strip())


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(model_chunks, optimizer, is_loading: bool) -> dict[str, Any]:
    """Megatron-LM's layout: ``model`` (``model{i}`` for further chunks) and ``optimizer``."""
    state = {("model" if i == 0 else f"model{i}"): chunk.module.sharded_state_dict()
             for i, chunk in enumerate(model_chunks)}
    state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading)
    return state


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler,
                    extra: dict[str, Any], monitor_state: Optional[dict] = None) -> str:
    """Save on all ranks (collective). ``extra`` holds e.g. the callbacks' state dicts;
    ``monitor_state`` (this rank's ``session.state_dict()``) goes into the distributed checkpoint."""
    _tolerate_missing_psutil()
    rank = torch.distributed.get_rank()
    path = iteration_dir(root, iteration)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    sharded = _sharded_state_dict(model_chunks, optimizer, False)
    if monitor_state is not None:  # every rank its own shard (errors, checkpoints; detector: writer)
        sharded[STATE_KEY] = state_shard(monitor_state)
    dist_checkpointing.save(sharded, path)
    extra_dir = os.path.join(path, EXTRA_DIR)
    os.makedirs(extra_dir, exist_ok=True)
    payload = {"version": EXTRA_VERSION, "iteration": iteration,
               "world_size": torch.distributed.get_world_size(),
               "scheduler": scheduler.state_dict(), "rng": _rng_state(), **extra}
    torch.save(payload, os.path.join(extra_dir, f"rank_{rank:05d}.pt"))
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(root, TRACKER), "w", encoding="utf-8") as f:
            f.write(str(iteration))
    torch.distributed.barrier()
    return path


_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "start_wd", "end_wd", "optimizer")
"""The param-group keys megatron-core matches saved groups by, besides ``max_lr`` / ``min_lr``."""


def use_flag_lr_bounds(saved: Any, current_groups: list[dict]) -> int:
    """Give every saved optimizer param group (any nesting of dicts and lists) the ``max_lr`` /
    ``min_lr`` of its current counterpart (the same other keys, in order); returns how many.

    With ``--override-opt_param-scheduler`` the flags' LR schedule wins. megatron-core restores
    each group's bounds from the checkpoint and, from 0.19 on, matches the saved groups to the
    current ones by them, so a resume with another ``--lr`` would fail ("Could not find parameter
    group with key ...") before the flags could win; this runs before the optimizer state loads."""
    changed = 0
    if isinstance(saved, dict):
        groups = saved.get("param_groups")
        if isinstance(groups, list):
            queues: dict[tuple, list[dict]] = {}
            for group in current_groups:
                queues.setdefault(tuple(group.get(k) for k in _GROUP_KEYS), []).append(group)
            for group in groups:
                queue = queues.get(tuple(group.get(k) for k in _GROUP_KEYS)) if isinstance(group, dict) else None
                if queue and "max_lr" in group:
                    current = queue.pop(0)
                    group["max_lr"], group["min_lr"] = current["max_lr"], current["min_lr"]
                    changed += 1
        changed += sum(use_flag_lr_bounds(v, current_groups) for k, v in saved.items() if k != "param_groups")
    elif isinstance(saved, (list, tuple)):
        changed += sum(use_flag_lr_bounds(v, current_groups) for v in saved)
    return changed


def load_checkpoint(root: str, model_chunks, optimizer, scheduler,
                    step: Optional[int] = None, flag_lr_bounds: bool = False
                    ) -> tuple[int, dict[str, Any], Optional[dict]]:
    """Load the checkpoint of iteration ``step`` (default: the tracker's, the latest) under
    ``root``; returns (iteration, extra state dict, this rank's monitor state or None). The
    tracker file is only read. ``flag_lr_bounds``: the optimizer groups keep the LR bounds the
    flags gave them (:func:`use_flag_lr_bounds`; ``--override-opt_param-scheduler``)."""
    iteration = read_tracker(root) if step is None else step
    if iteration is None:
        raise ValueError(f"--load {root!r}: no {TRACKER} found (nothing saved there yet?).")
    path = iteration_dir(root, iteration)
    if step is not None and not os.path.isdir(path):
        raise ValueError(f"--ckpt-step {step}: no {os.path.basename(path)} under --load {root!r}.")
    template = _sharded_state_dict(model_chunks, optimizer, True)
    in_checkpoint = add_load_template(template, path)  # only when the checkpoint holds it
    state = dist_checkpointing.load(template, path)
    for i, chunk in enumerate(model_chunks):
        chunk.module.load_state_dict(state["model" if i == 0 else f"model{i}"])
    if flag_lr_bounds:
        use_flag_lr_bounds(state["optimizer"], list(optimizer.param_groups))
    optimizer.load_state_dict(state["optimizer"])
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    extra_path = os.path.join(path, EXTRA_DIR, f"rank_{rank:05d}.pt")
    if not os.path.isfile(extra_path):
        extra_path = os.path.join(path, EXTRA_DIR, "rank_00000.pt")
    extra = torch.load(extra_path, weights_only=False)
    if extra.get("version") != EXTRA_VERSION:
        raise ValueError(f"{extra_path}: extra-state version {extra.get('version')} is not "
                         f"{EXTRA_VERSION}; this trainer cannot resume it.")
    scheduler.load_state_dict(extra["scheduler"])
    if extra["world_size"] == world:
        _set_rng_state(extra["rng"])
    else:
        logger.warning("world size changed (%d -> %d): RNG states not restored",
                       extra["world_size"], world)
    if in_checkpoint:
        monitor_state = loaded_state(state, path)
    else:  # an older trainer's checkpoint: the state in the extra file (one notice)
        monitor_state = trainer_extra_state(extra, extra_path)
    return iteration, extra, monitor_state
