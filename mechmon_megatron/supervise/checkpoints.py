"""Find the checkpoints under a ``--save`` folder and pick the one to roll back to.

Two layouts. The supervisor never writes or deletes a checkpoint; the one thing it moves is the
abort checkpoint, aside into ``SAVE/mechmon_aborted/launch-N/`` before a relaunch could overwrite
it (:func:`keep_aside`):

* Megatron (Megatron-LM, megatron-core's own loop and the example trainer): ``iter_0000012/``
  folders and ``latest_checkpointed_iteration.txt`` (the last complete save; ``release`` is
  Megatron's name for a converted checkpoint, which has no iteration and is never a rollback).
* DeepSpeed: one folder per tag (``global_step12/`` by default) and the ``latest`` file with
  the newest tag.

A folder counts as a checkpoint when it holds the files of a finished save; a folder newer than
the tracker's iteration is a save that did not finish (the tracker is written last).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_LATEST = "latest"
_ITER = re.compile(r"^iter_(\d{7})$")
_STEP = re.compile(r"(\d+)$")
_MEGATRON_MARKERS = ("metadata.json", ".metadata", "common.pt")
"""torch_dist (``.metadata``, ``metadata.json``, ``common.pt``); legacy saves have ``mp_rank_*``."""


@dataclass(frozen=True)
class Checkpoint:
    iteration: int
    """Training iterations completed when it was saved."""
    path: str
    name: str
    """``iter_0000012`` or the DeepSpeed tag."""
    layout: Literal["megatron", "deepspeed"]


ABORTED_DIR = "mechmon_aborted"
"""Under ``--save``: the abort checkpoints a relaunch would overwrite, ``launch-N/<name>/``, each with
its ``mechmon_alert.json``. Not a checkpoint folder of either layout, so never a rollback point."""


@dataclass(frozen=True)
class Selection:
    """The rollback point, or None, and why (one sentence for the log and the record)."""

    checkpoint: Optional[Checkpoint]
    after_change_point: bool
    why: str


def read_tracker(save: str) -> Optional[int]:
    """The iteration in ``latest_checkpointed_iteration.txt``; None when absent or ``release``."""
    path = os.path.join(save, MEGATRON_TRACKER)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def read_deepspeed_latest(save: str) -> Optional[str]:
    try:
        with open(os.path.join(save, DEEPSPEED_LATEST), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _megatron_complete(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n in names for n in _MEGATRON_MARKERS) or any(n.startswith("mp_rank_") for n in names)


def _deepspeed_complete(path: str) -> bool:
    try:
        return any(n.endswith("model_states.pt") for n in os.listdir(path))
    except OSError:
        return False


def list_checkpoints(save: str) -> list[Checkpoint]:
    """Finished checkpoints under ``save``, oldest first (empty when the folder does not exist)."""
    try:
        names = sorted(os.listdir(save))
    except OSError:
        return []
    tracker = read_tracker(save)
    found: list[Checkpoint] = []
    for name in names:
        path = os.path.join(save, name)
        match = _ITER.match(name)
        if match:
            iteration = int(match.group(1))
            if (tracker is None or iteration <= tracker) and _megatron_complete(path):
                found.append(Checkpoint(iteration=iteration, path=path, name=name, layout="megatron"))
        elif os.path.isdir(path) and _deepspeed_complete(path):
            step = _STEP.search(name)
            if step:
                found.append(Checkpoint(iteration=int(step.group(1)), path=path, name=name, layout="deepspeed"))
    return sorted(found, key=lambda c: (c.iteration, c.name))


def latest_checkpoint(save: str) -> Optional[Checkpoint]:
    """What the host loads from ``--load`` without a selection flag (tracker / ``latest``)."""
    tracker = read_tracker(save)
    tag = read_deepspeed_latest(save)
    for ckpt in list_checkpoints(save):
        megatron = ckpt.layout == "megatron" and ckpt.iteration == tracker
        if megatron or (ckpt.layout == "deepspeed" and ckpt.name == tag):
            return ckpt
    return None


def select_rollback(checkpoints: Sequence[Checkpoint], change_point: int, alarm_iteration: int) -> Selection:
    """The newest checkpoint saved at or before ``change_point`` (the detector's first-warning
    step), never the alarm's own abort checkpoint (it holds the state that alarmed). When none is
    that old, the oldest one before the alarm, flagged ``after_change_point``."""
    before_alarm = [c for c in checkpoints if c.iteration < alarm_iteration]
    reachable = [c for c in before_alarm if c.iteration <= change_point]
    if reachable:
        chosen = reachable[-1]
        return Selection(chosen, False, f"newest checkpoint at or before the change point (step {change_point}): "
                                        f"{chosen.name}")
    if before_alarm:
        chosen = before_alarm[0]
        return Selection(chosen, True, f"no checkpoint at or before the change point (step {change_point}); "
                                       f"{chosen.name} is the oldest before the alarm and was saved AFTER the change "
                                       "point: the rollback may keep part of the fault")
    return Selection(None, False, f"no finished checkpoint before the alarm at iteration {alarm_iteration}")


def folder_listing(save: str) -> dict[str, list[str]]:
    """Every checkpoint folder and its files (relative paths), to show nothing was lost."""
    listing: dict[str, list[str]] = {}
    for ckpt in list_checkpoints(save):
        files = []
        for root, _, names in os.walk(ckpt.path):
            files += [os.path.relpath(os.path.join(root, n), ckpt.path) for n in names]
        listing[ckpt.name] = sorted(files)
    return listing


def fingerprint(ckpt: Checkpoint) -> int:
    """The newest modification time (ns) of the checkpoint folder and its top-level entries: a
    save that rewrites the folder (same name, new files) changes it."""
    times = [os.stat(ckpt.path).st_mtime_ns]
    for entry in os.scandir(ckpt.path):
        times.append(entry.stat(follow_symlinks=False).st_mtime_ns)
    return max(times)


def fingerprints(save: str) -> dict[str, int]:
    """Every finished checkpoint under ``save`` -> its :func:`fingerprint` (taken before the first
    launch: what the folder held before this run)."""
    return {c.path: fingerprint(c) for c in list_checkpoints(save)}


def keep_aside(save: str, folder: str, launch: int) -> str:
    """Move ``folder`` (the abort checkpoint, or the alert file when the alert lies in ``save``
    itself) to ``save/mechmon_aborted/launch-<launch>/``; returns the new path. One rename on
    the same file system: nothing is copied or deleted. ``OSError`` when it cannot be moved."""
    target_dir = os.path.join(save, ABORTED_DIR, f"launch-{launch}")
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, os.path.basename(os.path.normpath(folder)))
    if os.path.exists(target):
        raise FileExistsError(f"{target} exists already")
    os.rename(folder, target)
    return target
