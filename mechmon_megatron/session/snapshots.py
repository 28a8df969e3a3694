"""Weight snapshots between a snapshot step and its check: placement, budget, lifecycle.

A check at step t compares the weights with a snapshot taken at t - delta. Snapshots are taken
every ``interval`` steps and each lives ``delta`` steps, so ``ceil(delta / interval)`` sets are
held at once (a ring keyed by the check step they serve). Lifecycle rules:

* a snapshot whose check step has passed without a check (the host skipped the step: a
  DeepSpeed overflow step, a Megatron skipped iteration) is dropped at the next step, so nothing
  stale accumulates and no check ever compares across a longer window than ``delta``;
* when one site's per-head rows and whole-layer rows are the same data (one owner, tensor
  parallel size 1; an MLA layer's down projections) they are copied once and the per-head
  snapshot is a view of the full one;
* placement: ``device`` (where the weights are), ``cpu`` (pageable host memory), ``pinned``
  (page-locked host memory, asynchronous device-to-host copies into reused buffers), or ``auto``:
  ``device`` unless the budget exceeds ``snapshot_max_device_share`` of the accelerator's memory.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable, Optional, Sequence, Union

import torch

from mechmon_megatron.monitors.norm_fold import NormFold
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import AttentionSite, FullQK, MLAHeads, QKWeights
from mechmon_megatron.session.log import mechmon_log

log = mechmon_log(__name__)

MIB = 1024 * 1024


def snapshot_bytes(config: MechmonConfig, sites: Sequence[AttentionSite]) -> Optional[int]:
    """Bytes this rank's snapshots hold at most (all sets alive at once); None if a site is unknown."""
    budgets = [s.snapshot_budget for s in sites]
    if any(b is None for b in budgets):
        return None
    per_set = sum(b.nbytes(config.full_matrix_dw) for b in budgets if b is not None)
    return per_set * config.overlap


def site_bytes(config: MechmonConfig, sites: Sequence[AttentionSite]) -> list[tuple[int, int]]:
    """``(layer_number, bytes)`` of every site's snapshots on this rank (all sets alive at once;
    sites of unknown size left out), in site order: names the layer at which a budget overflows."""
    return [(s.layer_number, b.nbytes(config.full_matrix_dw) * config.overlap)
            for s in sites if (b := s.snapshot_budget) is not None]


def weights_device(sites: Sequence[AttentionSite]) -> torch.device:
    devices = {b.device for s in sites if (b := s.snapshot_budget) is not None}
    return next(iter(devices)) if len(devices) == 1 else torch.device("cpu")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_world_size() -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``, else Slurm's tasks per node, else 1):
    they share the host's memory."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "")
        head = value.split("(")[0].split(",")[0]  # Slurm may say "8(x2)"
        if head.isdigit() and int(head) > 0:
            return int(head)
    return 1


def host_memory_share() -> int:
    """This rank's share of the host's memory: the node's RAM divided by the ranks on the node."""
    return host_memory_bytes() // local_world_size()


PLACEMENTS = ("device", "pinned", "cpu")
"""Snapshot placements, from the one that uses the accelerator's memory to the most conservative
(host memory, pageable): the job takes the most conservative one any rank's ``auto`` picks."""


def device_memory_bytes(device: torch.device) -> int:
    """The accelerator's memory (bytes) of a CUDA ``device``."""
    return int(torch.cuda.get_device_properties(device).total_memory)


def resolve_placement(config: MechmonConfig, nbytes: Optional[int], device: torch.device,
                      layers: Sequence[tuple[int, int]] = ()) -> str:
    """``device``, ``cpu`` or ``pinned`` for this rank (``auto`` resolved, CPU jobs: host memory).

    ``ValueError`` naming the flags (and, from ``layers`` = ``site_bytes``, the layer at which the
    budget overflows) when it cannot fit where it must go: half of the accelerator's memory, or
    half of this rank's share of the host's memory (``host_memory_share``).
    """
    placement = choose_placement(config, nbytes, device)
    _check_fits(config, nbytes, device, placement, layers)
    return placement


def placement_problem(config: MechmonConfig, nbytes: Optional[int], device: torch.device, placement: str,
                      layers: Sequence[tuple[int, int]] = ()) -> Optional[str]:
    """Why this rank's snapshots cannot go to ``placement`` (the message of :func:`resolve_placement`'s
    ``ValueError``), or None when they fit there."""
    try:
        _check_fits(config, nbytes, device, placement, layers)
    except ValueError as exc:
        return str(exc)
    return None


def choose_placement(config: MechmonConfig, nbytes: Optional[int], device: torch.device) -> str:
    """This rank's own placement for ``--mechmon-snapshot-device`` (``auto``: ``pinned`` when the
    snapshots exceed ``snapshot_max_device_share`` of the accelerator, else ``device``); no fit check."""
    setting = config.snapshot_device
    if device.type != "cuda":
        if setting == "pinned":
            log.warning("--mechmon-snapshot-device pinned needs a CUDA device; the weights are on %s, "
                        "so snapshots use ordinary host memory", device)
        placement = "cpu" if setting in ("cpu", "pinned") else "device"
    elif setting != "auto":
        placement = setting
    else:
        total = device_memory_bytes(device)
        big = nbytes is not None and nbytes > config.snapshot_max_device_share * total
        placement = "pinned" if big else "device"
    return placement


def _check_fits(config: MechmonConfig, nbytes: Optional[int], device: torch.device, placement: str,
                layers: Sequence[tuple[int, int]] = ()) -> None:
    if nbytes is None:
        return
    on_device = placement == "device" and device.type == "cuda"
    capacity = device_memory_bytes(device) if on_device else host_memory_share()
    if nbytes > 0.5 * capacity:
        ranks = local_world_size()
        where = (f"{device} ({capacity / MIB:.0f} MiB)" if on_device else
                 f"this rank's share of host memory ({capacity / MIB:.0f} MiB"
                 f"{f', 1/{ranks} of the node' if ranks > 1 else ''})")
        total, at = 0, None
        for layer, size in layers:  # the layer whose snapshots cross the limit
            total += size
            if total > 0.5 * capacity:
                at = layer
                break
        layer_text = f" (the limit is crossed at layer {at})" if at is not None else ""
        raise ValueError(
            f"mechmon snapshots would hold {nbytes / MIB:.0f} MiB on this rank{layer_text}, more than half of "
            f"{where}: lower "
            f"--mechmon-delta (now {config.delta}; {config.overlap} snapshot sets are held at once), pass "
            "--mechmon-no-full-matrix-dw, or choose another --mechmon-snapshot-device"
        )


def describe_budget(config: MechmonConfig, nbytes: Optional[int], device: torch.device, placement: str,
                    rank: int) -> str:
    """The start-up line: ``mechmon: snapshots hold N MiB on <device>`` plus how it was chosen."""
    where = {"device": str(device), "cpu": "cpu", "pinned": "cpu (pinned)"}[placement]
    size = "an unknown amount" if nbytes is None else f"{nbytes / MIB:.4g} MiB"
    sets = config.overlap
    ring = (f"; {sets} sets held at once (delta {config.delta} > interval {config.interval})" if sets > 1 else "")
    return (f"mechmon: snapshots hold {size} on {where} (rank {rank}; --mechmon-snapshot-device "
            f"{config.snapshot_device}{ring})")


Record = Union[QKWeights, MLAHeads, FullQK]
SiteSnapshot = tuple[Optional[Union[QKWeights, MLAHeads]], Optional[FullQK]]
"""One site's snapshot: its per-head read and its full-matrix read (None where this rank has none)."""


class SnapshotStore:
    """The snapshots of one rank, keyed by the check step that consumes them."""

    def __init__(self, placement: str) -> None:
        self.placement = placement
        self._sets: dict[int, dict[int, SiteSnapshot]] = {}
        self._pool: dict[tuple, list[torch.Tensor]] = {}  # pinned buffers for reuse

    def __len__(self) -> int:
        return len(self._sets)

    def check_steps(self) -> list[int]:
        return sorted(self._sets)

    def nbytes(self) -> int:
        """Bytes held now (views of a shared copy counted once)."""
        seen: dict[int, int] = {}
        for taken in self._sets.values():
            for pair in taken.values():
                for t in _pair_tensors(pair):
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def put(self, check_step: int, taken: dict[int, SiteSnapshot]) -> None:
        self._sets[check_step] = taken

    def peek(self, check_step: int) -> Optional[dict[int, SiteSnapshot]]:
        """The set for ``check_step`` left in the ring (the short window reads it early)."""
        return self._sets.get(check_step)

    def pop(self, check_step: int) -> Optional[dict[int, SiteSnapshot]]:
        return self._sets.pop(check_step, None)

    def release(self, taken: Optional[dict]) -> None:
        """Give a consumed set's pinned buffers back for the next snapshot (each copy once: the
        tensor that spans its whole storage, not the views of it)."""
        if self.placement != "pinned" or not taken:
            return
        for pair in taken.values():
            seen: set[int] = set()
            for t in _pair_tensors(pair):
                storage = t.untyped_storage()
                if storage.data_ptr() in seen or t.storage_offset() != 0 or \
                        t.numel() * t.element_size() != storage.nbytes():
                    continue
                seen.add(storage.data_ptr())
                self._pool.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def drop_stale(self, iteration: int) -> list[int]:
        """Drop snapshots for check steps before ``iteration`` (their check never ran)."""
        stale = [step for step in self._sets if step < iteration]
        for step in stale:
            self.release(self._sets.pop(step))
        return stale

    # ---------------------------------------------------------------- copies
    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` at this store's placement (asynchronous into pinned memory)."""
        src = t.detach()
        if self.placement == "device":
            return src.clone(memory_format=torch.contiguous_format)
        if self.placement == "cpu":
            return src.to("cpu", copy=True).contiguous()
        pool = self._pool.get((tuple(src.shape), src.dtype))
        dst = pool.pop() if pool else torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        # Ordered on the current stream before the optimizer's next update of the weights, and
        # read back only by device kernels enqueued after it: no host synchronisation needed.
        dst.copy_(src, non_blocking=True)
        return dst

    def take(self, heads: Optional[Union[QKWeights, MLAHeads]], full: Optional[FullQK]) -> SiteSnapshot:
        """Copies of one site's reads. A tensor that is the same memory as one copied before in
        this call (per-head rows that are the full rows, with tensor parallel size 1; an MLA down
        projection in both reads) becomes a view of that copy: one copy, shared."""
        copies = _SharedCopies(self.copy)
        full_copy = FullQK(wq=copies(full.wq), wk=copies(full.wk)) if full is not None else None
        if isinstance(heads, QKWeights):
            return QKWeights(wq=copies(heads.wq), wk=copies(heads.wk), head_offset=heads.head_offset,
                             q_norm=_copy_norm(heads.q_norm, copies),
                             k_norm=_copy_norm(heads.k_norm, copies)), full_copy
        if isinstance(heads, MLAHeads):
            return replace(heads, weights=heads.weights.map(copies)), full_copy
        return None, full_copy


class _SharedCopies:
    """Copies tensors, once per distinct memory: a tensor that is the same contiguous elements of
    one storage as a tensor copied earlier gets a view of that copy (decided from the memory alone:
    no read of the values, no device synchronisation)."""

    def __init__(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._copy = copy
        self._done: dict[tuple, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():
            return self._copy(t)
        key = (t.data_ptr(), t.numel(), t.dtype, t.device)
        done = self._done.get(key)
        if done is None:
            done = self._done[key] = self._copy(t)
        return done.view(t.shape)


def _copy_norm(norm: Optional[NormFold], copies: _SharedCopies) -> Optional[NormFold]:
    if norm is None or norm.gamma is None:
        return norm
    return NormFold(gamma=copies(norm.gamma), centres=norm.centres)


def _record_tensors(record: Optional[Record]) -> list[torch.Tensor]:
    """Every tensor a snapshot record holds."""
    if record is None:
        return []
    if isinstance(record, MLAHeads):
        return record.weights.tensors()
    out = [record.wq, record.wk]
    if isinstance(record, QKWeights):
        out += [n.gamma for n in (record.q_norm, record.k_norm) if n is not None and n.gamma is not None]
    return out


def _pair_tensors(pair: SiteSnapshot) -> list[torch.Tensor]:
    heads, full = pair
    return _record_tensors(full) + _record_tensors(heads)
