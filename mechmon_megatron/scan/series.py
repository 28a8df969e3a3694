"""Find the checkpoint series in the command-line paths: which checkpoints, in which order.

Each path is either a run directory (checkpoints inside it) or one checkpoint:

==================  ==============================================  ===============================
format              run directory                                   one checkpoint, its iteration
==================  ==============================================  ===============================
Megatron torch_dist ``latest_checkpointed_iteration.txt``, ``iter_*``  ``iter_0000050/`` -> 50
Megatron legacy     the same                                        ``iter_0000050/mp_rank_*/``
DeepSpeed           ``latest``, ``global_step*``                    ``global_step50/`` -> 50 (or
                                                                    ``global_steps`` in the file)
HF safetensors      ``checkpoint-*`` (or any sub-folders)           ``checkpoint-500/`` -> 500 (the
                                                                    folder name's last number)
==================  ==============================================  ===============================

A Megatron ``iter_*`` directory newer than the tracker file is an interrupted save and is left
out (megatron writes the tracker last), with a notice.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.readers import detect_format

logger = logging.getLogger(__name__)

__all__ = ["CheckpointRef", "SkippedCheckpoint", "discover"]

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
ABORTED_DIR = "mechmon_aborted"
"""Where mechmon-supervise keeps each abort checkpoint, ``launch-K/<name>/`` (docs/RECOVERY.md)."""
_ITER = re.compile(r"^iter_(\d+)$")
_STEP = re.compile(r"^global_step(\d+)$")
_HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
KNOWN = "a Megatron iter_XXXXXXX directory (torch_dist or legacy mp_rank_*), a DeepSpeed global_stepN directory, " \
        "a folder of *.safetensors, or a run directory holding such checkpoints"


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    """One checkpoint of the series."""

    iteration: int
    path: str
    format: str


def _iteration_of(path: str) -> int | None:
    name = os.path.basename(os.path.normpath(path))
    for pattern in (_ITER, _STEP):
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    match = _LAST_NUMBER.search(name)
    return int(match.group(1)) if match else None


def _tracker(run_dir: str) -> int | None:
    path = os.path.join(run_dir, MEGATRON_TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip())
    except ValueError:
        return None  # "release" or garbage: no limit


def _one(path: str) -> CheckpointRef | None:
    fmt = detect_format(path)
    if fmt is None:
        return None
    iteration = _iteration_of(path)
    if iteration is None:
        raise ScanInputError(
            f"{path}: cannot tell this checkpoint's iteration from its name; expected iter_XXXXXXX, "
            "global_stepN or a folder name ending in the step (checkpoint-500)."
        )
    return CheckpointRef(iteration=iteration, path=os.path.abspath(path), format=fmt)


@dataclass(frozen=True, slots=True)
class SkippedCheckpoint:
    """A folder of a run directory named like a checkpoint that the scan leaves out, and why."""

    path: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


def _why_unreadable(path: str) -> str:
    names = os.listdir(path)
    if not names:
        return "empty folder"
    if any(n.endswith(".distcp") for n in names) and ".metadata" not in names:
        return "has *.distcp shards but no .metadata: an incomplete or damaged torch_dist save"
    return f"no checkpoint of a known format inside (expected {KNOWN})"


def _in_run_dir(run_dir: str, skipped: list[SkippedCheckpoint]) -> list[CheckpointRef]:
    limit = _tracker(run_dir)
    found = []
    for name in sorted(os.listdir(run_dir)):
        sub = os.path.join(run_dir, name)
        if not os.path.isdir(sub):
            continue
        ref = _one(sub)
        if ref is None:
            if _ITER.match(name) or _STEP.match(name) or _HF_CHECKPOINT.match(name):
                skipped.append(SkippedCheckpoint(os.path.abspath(sub), _why_unreadable(sub)))
            continue
        if limit is not None and _ITER.match(name) and ref.iteration > limit:
            skipped.append(SkippedCheckpoint(ref.path, f"newer than {MEGATRON_TRACKER} ({limit}): an interrupted "
                                                       "save"))
            continue
        found.append(ref)
    return found


def kept_abort_checkpoints(run_dir: str) -> list[str]:
    """The abort checkpoints mechmon-supervise moved aside in ``run_dir`` (``mechmon_aborted/launch-K/*``)."""
    root = os.path.join(run_dir, ABORTED_DIR)
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, launch, name) for launch in os.listdir(root)
                  if os.path.isdir(os.path.join(root, launch)) for name in os.listdir(os.path.join(root, launch))
                  if os.path.isdir(os.path.join(root, launch, name)))


def discover(paths: tuple[str, ...], window: int) -> tuple[list[CheckpointRef], list[SkippedCheckpoint]]:
    """The series, sorted by iteration, and the folders named like checkpoints that were left
    out (each logged as a warning). ScanInputError for unknown paths, mixed formats, duplicate
    iterations, or fewer than ``window + 1`` checkpoints."""
    refs: list[CheckpointRef] = []
    skipped: list[SkippedCheckpoint] = []
    for path in paths:
        kept = kept_abort_checkpoints(path) if os.path.isdir(path) else []
        if kept:
            logger.warning("%s: %d abort checkpoint(s) kept by mechmon-supervise, not part of this folder's series "
                           "(its relaunch saved the same iterations again): %s. To scan the alarmed weights, name "
                           "the saves before the rollback point and one of these, each as a path (docs/SCAN.md).",
                           path, len(kept), ", ".join(kept))
        if not os.path.exists(path):
            raise ScanInputError(f"{path}: no such file or directory; expected {KNOWN}.")
        if os.path.isfile(path):
            raise ScanInputError(f"{path}: a file; pass its checkpoint directory instead ({KNOWN}).")
        ref = _one(path)
        if ref is not None:
            refs.append(ref)
            continue
        inside = _in_run_dir(path, skipped)
        if not inside:
            raise ScanInputError(f"{path}: no checkpoint found; expected {KNOWN}.")
        refs.extend(inside)
    for skip in skipped:
        logger.warning("%s: left out of the scan: %s", skip.path, skip.reason)
    formats = sorted({r.format for r in refs})
    if len(formats) > 1:
        raise ScanInputError(f"the checkpoints mix formats {formats}; scan one series (one format) at a time.")
    refs.sort(key=lambda r: r.iteration)
    for a, b in zip(refs, refs[1:]):
        if a.iteration == b.iteration:
            raise ScanInputError(f"{a.path} and {b.path} are both iteration {a.iteration}; pass one series.")
    if len(refs) < window + 1:
        found = ", ".join(r.path for r in refs) or "none"
        raise ScanInputError(
            f"found {len(refs)} checkpoint(s) ({found}); a scan compares checkpoint t with t - {window} "
            f"(--window {window}), so it needs at least {window + 1} checkpoints of one run."
        )
    return refs, skipped
