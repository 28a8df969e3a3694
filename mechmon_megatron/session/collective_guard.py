"""Collectives that every rank enters, whatever failed locally before them.

A monitor read that gathers weights over a process group has local work before the collective
(a contiguous copy, receive buffers). If that work raises on one rank (an out-of-memory error,
say) and the rank skips the collective, its peers wait in it until the communication timeout: a
hang of the whole job. :func:`guarded_collective` runs the local part under ``try``, lets every
rank of the group agree on the outcome in one small all-reduce, and only then runs the
collective, or raises on every rank of the group. The session's guard then catches the error on
all of them alike (``mechmon/errors``; strict mode stops every rank together).

A failure inside the collective itself belongs to the communication library (it fails the
training collectives too) and is not covered.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
R = TypeVar("R")


class PeerFailure(RuntimeError):
    """Raised on the ranks whose own part succeeded when a peer of the group failed its part."""


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_ok(ok: bool, group: Any, device: Optional[torch.device] = None) -> bool:
    """True on every rank of ``group`` iff ``ok`` is True on all of them (one int all-reduce).

    Every rank of the group must call it exactly once per agreement. ``device``: where the flag
    lives (NCCL needs the rank's CUDA device; gloo takes the default, the CPU).
    """
    if _group_size(group) == 1:
        return ok
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def guarded_collective(
    local: Callable[[], T],
    collective: Callable[[T], R],
    group: Any,
    what: str,
    device: Optional[torch.device] = None,
) -> R:
    """Run ``collective(local())`` on every rank of ``group``, or raise on all of them.

    ``local`` is the rank's own preparation (may raise); ``collective`` is entered by every rank
    only when all prepared successfully. The failing rank re-raises its own exception; the others
    raise :class:`PeerFailure` naming ``what``.
    """
    error: Optional[BaseException] = None
    prepared: Any = None
    try:
        prepared = local()
    except Exception as exc:  # noqa: BLE001 -- re-raised below, after the peers know
        error = exc
    if not all_ok(error is None, group, device):
        if error is not None:
            raise error
        raise PeerFailure(f"a peer rank failed before the collective of {what}; skipped on every rank")
    return collective(prepared)
