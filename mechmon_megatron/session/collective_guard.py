"""Every collective mechmon issues: on process groups of its own, with a bounded wait, counted.

This is the one module of the product that calls ``torch.distributed`` collectives
(``tests/test_architecture.py`` fails on a call anywhere else). It does three things:

* **Own groups, bounded wait.** Each host group a monitor communicates over (the tensor-parallel
  group of a layer, the data-parallel group of the main parameters, the router's token group,
  the whole job) is mirrored by a group of mechmon's own with the same ranks and backend, created
  with ``timeout = --mechmon-collective-timeout``. The adapters :meth:`~CollectiveGuard.declare`
  the host groups while they build the sites; the session's start-up makes them all at once
  (:meth:`~CollectiveGuard.create_declared`: one exchange of the declared rank lists over the
  whole job, then ``dist.new_group`` for each, in one order, on every rank, as
  ``torch.distributed`` requires and Megatron does for its own groups). A monitor collective that a
  peer never enters -- the peer raised at the call itself, as a communication library's own
  out-of-memory or transport error does -- gives up after that timeout instead of the host's
  ``--distributed-timeout-minutes``, and training's own communicators are never used or touched.
* **Down once, down for good.** A collective that raises or times out leaves its group out of
  step (the peers may be inside it, or past it), so this rank issues no further monitor
  collective on any group: every later call raises :class:`CollectivesOff` at once, without
  communicating. The session turns that into one agreed outcome at the end of the step
  (:meth:`CollectiveGuard.agree_up`): every rank learns, by a ``False`` or by the same timeout,
  that a monitor collective failed, and turns the monitors off (or, under ``--mechmon-strict``,
  stops) at that step.
* **Groups of mechmon's own without a host twin.** :meth:`~CollectiveGuard.declare_member` names
  a group by membership (the ranks that report at a check); with a ``part`` (the rank's
  tensor-parallel group) it is made in two levels (:class:`Tiers`: one group per part, and one of
  the parts' leaders), so the check records travel to one owner per part, then to the writer.
* **Agreement before the collective.** :meth:`CollectiveGuard.guarded` runs a rank's local
  preparation (a contiguous copy, receive buffers) under ``try`` and lets every rank of the group
  agree in one small all-reduce before anyone enters the collective: a local failure raises on
  every rank of the group (the others raise :class:`PeerFailure`) and leaves the group usable.

Collectives the host runs on mechmon's behalf (ZeRO reads of a DeepSpeed parameter, megatron-core's
forced parameter all-gather) run on the host's groups: :meth:`CollectiveGuard.host_collective`
runs them inside the failure log and counts their time, but their wait is the host's own timeout
(they are the host's communicator, which training uses too). They follow the check schedule on
every rank, whatever the local monitor state, so every rank issues the same host collectives.

A byte counter (:class:`CommCounter`) records what each monitor collective moves on this rank:
``sent`` the bytes this rank contributes, ``received`` the bytes it obtains from other ranks
(logical payload, not the wire traffic of the backend's algorithm).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from mechmon_megatron.session.log import mechmon_log

log = mechmon_log(__name__)

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT_S = 120.0
"""``--mechmon-collective-timeout`` when neither the user nor the host's timeout sets it."""


class PeerFailure(RuntimeError):
    """Raised on the ranks whose own part succeeded when a peer of the group failed its part."""


class CollectiveFailure(RuntimeError):
    """A monitor collective raised or timed out on this rank; mechmon's collectives are now off here."""


class CollectivesOff(RuntimeError):
    """A monitor collective failed earlier on this rank: no further one is issued (none communicates)."""


@dataclass
class CommCounter:
    """Bytes and seconds of the monitor collectives on this rank since the last :meth:`take`."""

    sent_bytes: int = 0
    received_bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    messages: int = 0
    """Peers whose own contribution reaches this rank as sent (not reduced on the way): a gather's
    root counts its group's other ranks, an all-gather every rank the other ranks, a broadcast's
    receiver one. An all-reduce counts none: what each rank receives there is the backend's
    algorithm (a ring or a tree), its bytes are counted."""

    def add(self, sent: int, received: int, seconds: float, messages: int = 0) -> None:
        self.sent_bytes += int(sent)
        self.received_bytes += int(received)
        self.seconds += seconds
        self.calls += 1
        self.messages += int(messages)

    def take(self) -> dict:
        """The counts so far (a dict for JSON), then zero."""
        out = asdict(self)
        self.sent_bytes = self.received_bytes = self.calls = self.messages = 0
        self.seconds = 0.0
        return out


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Members:
    """A group of mechmon's own that no host group mirrors (e.g. the ranks that report at a check):
    its global ranks, sorted; made by :meth:`CollectiveGuard.create_declared`."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Tiers:
    """A group of mechmon's own in two levels (e.g. the reporting ranks, by tensor-parallel group):
    its members split into parts, each part with one leader; the leaders form the upper level.

    ``parts``: ``(leader, part)`` per part, by leader's global rank; ``leaders``: every part's leader
    (sorted); ``part`` / ``leader``: this rank's part and its leader (``Members(())`` and -1 on a rank
    that is not a member). Made by :meth:`CollectiveGuard.create_declared`, the same on every rank.
    """

    parts: tuple[tuple[int, Members], ...]
    leaders: Members
    part: Members
    leader: int

    def part_of(self, leader: int) -> Members:
        """The part whose leader is global rank ``leader``."""
        return dict(self.parts)[leader]


def group_size(group: Any) -> int:
    """Ranks in ``group`` (a host group, None for the whole job, or :class:`Members`; 1 without
    torch.distributed)."""
    if isinstance(group, Members):
        return len(group.ranks)
    return dist.get_world_size(group) if _distributed() else 1


def group_rank(group: Any) -> int:
    """This rank's index in ``group`` (0 without torch.distributed)."""
    if not _distributed():
        return 0
    if isinstance(group, Members):
        return group.ranks.index(dist.get_rank())
    return dist.get_rank(group)


def group_device(group: Any) -> torch.device:
    """Where a collective's tensors must live for ``group``: the rank's CUDA device under NCCL."""
    if isinstance(group, Members):
        group = None
    if _distributed() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CollectiveGuard:
    """mechmon's communicators on this rank: own groups, the down state, the byte counter.

    One per process (:func:`guard`), as ``torch.distributed`` keeps one default group per process:
    a rank is one process, and a down communicator is down for every session the process builds
    (DeepSpeed's adapter builds a fresh session after a load). The host looks it up once and
    passes it to its communicator, its sites and its session.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = float(timeout_s)
        self.down: Optional[str] = None
        """Why mechmon's collectives are off on this rank (None: they are on)."""
        self.world_broken = False
        """The failure was on mechmon's whole-job group itself (the end-of-step agreement cannot use it)."""
        self.counter = CommCounter()
        self._groups: dict[tuple[int, ...], Any] = {}
        """rank tuple -> mechmon's group (``GroupMember.NON_GROUP_MEMBER`` where this rank is not in it)."""
        self._declared: dict[tuple[int, ...], str] = {}
        self._membership: dict[str, bool] = {}
        self._members: dict[str, Members] = {}
        self._parts: dict[str, tuple[tuple[int, ...], int]] = {}
        """name -> (this rank's part label: the ranks of its host group, the leader it prefers)."""
        self._tiers: dict[str, Tiers] = {}

    # ---------------------------------------------------------------- groups
    def configure(self, timeout_s: float) -> None:
        """Set the timeout for the groups created from now on (start-up, before any monitor collective)."""
        if self._groups and float(timeout_s) != self.timeout_s:
            log.warning("--mechmon-collective-timeout %g s: mechmon's process groups already exist with "
                        "%g s, which stays", timeout_s, self.timeout_s)
            return
        self.timeout_s = float(timeout_s)

    @staticmethod
    def _ranks(host_group: Any) -> tuple[int, ...]:
        if isinstance(host_group, Members):
            return host_group.ranks
        return tuple(dist.get_process_group_ranks(host_group if host_group is not None else dist.group.WORLD))

    def declare_member(self, name: str, member: bool, part: Optional[tuple[int, ...]] = None,
                       leader: int = -1) -> None:
        """Whether this rank belongs to mechmon's group ``name`` (local; made by :meth:`create_declared`).

        ``part`` (the global ranks of a host group, e.g. this rank's tensor-parallel group) makes
        ``name`` a two-level group (:meth:`tiers`): the members with the same ``part`` form one
        part, led by global rank ``leader`` when it is a member of it, else by its lowest member.
        """
        self._membership[name] = bool(member)
        if part is not None:
            self._parts[name] = (tuple(int(r) for r in part), int(leader))

    def members(self, name: str) -> Members:
        """The ranks of group ``name`` as agreed at the session's start (:meth:`declare_member`)."""
        if name not in self._members:
            me = dist.get_rank() if _distributed() else 0
            return Members((me,)) if self._membership.get(name, True) else Members(())
        return self._members[name]

    def tiers(self, name: str) -> Tiers:
        """The two-level layout of group ``name`` as agreed at the session's start (declared with a
        ``part``); without torch.distributed, or before the start: this rank alone."""
        if name in self._tiers:
            return self._tiers[name]
        me = dist.get_rank() if _distributed() else 0
        alone = Members((me,))
        return Tiers(parts=((me, alone),), leaders=alone, part=alone, leader=me)

    @staticmethod
    def _make_tiers(name: str, everyone: list, me: int) -> Tiers:
        """The parts of ``name`` from every rank's ``(membership, parts)`` declarations (same on all ranks)."""
        by_label: dict[tuple[int, ...], list[int]] = {}
        preferred: dict[tuple[int, ...], int] = {}
        for rank, (_, flags, parts) in enumerate(everyone):
            if not dict(flags).get(name, False) or name not in dict(parts):
                continue
            label, leader = dict(parts)[name]
            by_label.setdefault(label, []).append(rank)
            preferred.setdefault(label, leader)
        out: list[tuple[int, Members]] = []
        for label in sorted(by_label):
            ranks = tuple(sorted(by_label[label]))
            out.append((preferred[label] if preferred[label] in ranks else ranks[0], Members(ranks)))
        out.sort()
        mine = [(leader, part) for leader, part in out if me in part.ranks]
        leader, part = mine[0] if mine else (-1, Members(()))
        return Tiers(parts=tuple(out), leaders=Members(tuple(leader for leader, _ in out)), part=part, leader=leader)

    def declare(self, host_group: Any = None) -> None:
        """This rank's monitors will communicate over ``host_group`` (None: the whole job); local,
        no communication. Call while building the sites, before the session starts."""
        if _distributed() and group_size(host_group) > 1:
            self._declared.setdefault(self._ranks(host_group), str(dist.get_backend(host_group)))

    def create_declared(self) -> int:
        """Every rank, once per session start: make mechmon's copy of every group any rank declared.

        One ``all_gather_object`` of the declared rank lists over the host's whole-job group, then
        ``dist.new_group(ranks, timeout=--mechmon-collective-timeout)`` for each new one in sorted
        order on every rank (members and non-members alike). Returns how many were made.
        """
        if not _distributed() or group_size(None) == 1:
            return 0
        self.declare(None)
        everyone: list = [None] * group_size(None)
        dist.all_gather_object(everyone, (sorted(self._declared.items()), sorted(self._membership.items()),
                                          sorted(self._parts.items())))
        wanted = dict(item for declared, _, _ in everyone for item in declared)
        backend = str(dist.get_backend(None))
        me = dist.get_rank()
        for name in sorted({name for _, flags, _ in everyone for name, _ in flags}):
            ranks = tuple(rank for rank, (_, flags, _) in enumerate(everyone) if dict(flags).get(name, False))
            self._members[name] = Members(ranks)
            if len(ranks) > 1:
                wanted.setdefault(ranks, backend)
            if any(name in dict(parts) for _, _, parts in everyone):
                tiers = self._make_tiers(name, everyone, me)
                self._tiers[name] = tiers
                for group in (tiers.leaders, *(part for _, part in tiers.parts)):
                    if len(group.ranks) > 1:
                        wanted.setdefault(group.ranks, backend)
        made = 0
        for ranks in sorted(set(wanted) - set(self._groups)):
            self._groups[ranks] = dist.new_group(list(ranks), timeout=timedelta(seconds=self.timeout_s),
                                                 backend=wanted[ranks])
            made += 1
        self._declared.clear()
        self._membership.clear()
        self._parts.clear()
        return made

    def own(self, host_group: Any = None) -> Any:
        """mechmon's group with the ranks of ``host_group`` (None: the whole job); ``RuntimeError``
        when no rank declared it before the session started (its collective then counts as failed)."""
        ranks = self._ranks(host_group)
        mine = self._groups.get(ranks)
        if mine is None:
            raise RuntimeError(f"mechmon: no own process group for ranks {list(ranks)[:8]}: the adapter did not "
                               "declare this host group before the session started (CollectiveGuard.declare)")
        return mine

    @staticmethod
    def _global(group: Any, own: Any, group_rank_: int) -> int:
        """The global rank of ``group``'s rank ``group_rank_`` (mechmon's groups keep the host's order)."""
        if isinstance(group, Members):
            return group.ranks[group_rank_]
        return dist.get_global_rank(own, group_rank_)

    # ---------------------------------------------------------------- the one path every collective takes
    def _run(self, what: str, host_group: Any, call: Callable[[Any], T], sent: int, received: int,
             world: bool = False, messages: int = 0) -> T:
        if self.down is not None:
            raise CollectivesOff(f"{what}: skipped, mechmon's collectives are off on this rank ({self.down})")
        start = time.perf_counter()
        try:
            out = call(self.own(host_group))
        except Exception as exc:  # noqa: BLE001 -- re-raised below, after the rank knows it is down
            self.down = f"{what}: {type(exc).__name__}: {exc}"
            self.world_broken = world or group_size(host_group) == group_size(None)
            raise CollectiveFailure(
                f"{what} failed or timed out (--mechmon-collective-timeout {self.timeout_s:g} s): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self.counter.add(sent, received, time.perf_counter() - start, messages)
        return out

    def all_ok(self, ok: bool, group: Any, what: str = "the agreement before a monitor collective") -> bool:
        """True on every rank of ``group`` iff ``ok`` on all of them (one int32 all-reduce, MIN)."""
        if not _distributed() or group_size(group) == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=group_device(group))
        self._run(what, group, lambda g: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g), 4, 4)
        return bool(flag.item())

    def guarded(self, local: Callable[[], T], collective: Callable[[T], R], group: Any, what: str) -> R:
        """``collective(local())`` on every rank of ``group``, or an exception on all of them.

        ``local`` is the rank's own preparation (may raise); ``collective`` (which issues its
        communication through this guard) is entered by every rank only when all prepared. The
        failing rank re-raises its own exception; the others raise :class:`PeerFailure`.
        """
        error: Optional[BaseException] = None
        prepared: Any = None
        try:
            prepared = local()
        except Exception as exc:  # noqa: BLE001 -- re-raised below, after the peers know
            error = exc
        if not self.all_ok(error is None, group, f"the agreement before {what}"):
            if error is not None:
                raise error
            raise PeerFailure(f"a peer rank failed before the collective of {what}; skipped on every rank")
        return collective(prepared)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor, group: Any, what: str) -> None:
        """``dist.all_gather(parts, tensor)`` over mechmon's copy of ``group``."""
        n = group_size(group)
        if not _distributed() or n == 1:
            parts[0].copy_(tensor)
            return
        size = _nbytes(tensor)
        self._run(what, group, lambda g: dist.all_gather(parts, tensor, group=g), size, (n - 1) * size,
                  messages=n - 1)

    def all_reduce(self, tensor: torch.Tensor, group: Any, what: str, op: Any = None) -> torch.Tensor:
        """In-place ``dist.all_reduce`` (default SUM) over mechmon's copy of ``group``; returns ``tensor``."""
        if not _distributed() or group_size(group) == 1:
            return tensor
        reduce_op = dist.ReduceOp.SUM if op is None else op
        size = _nbytes(tensor)
        self._run(what, group, lambda g: dist.all_reduce(tensor, op=reduce_op, group=g), size, size)
        return tensor

    def gather(self, tensor: torch.Tensor, dst_group_rank: int, group: Any, what: str) -> Optional[list[torch.Tensor]]:
        """Every rank's ``tensor`` (same shape and dtype on all) on rank ``dst_group_rank`` of ``group``."""
        n = group_size(group)
        if not _distributed() or n == 1:
            return [tensor]
        me = group_rank(group)
        out = [torch.empty_like(tensor) for _ in range(n)] if me == dst_group_rank else None
        size = _nbytes(tensor)

        def call(g: Any) -> None:
            dist.gather(tensor, out, dst=self._global(group, g, dst_group_rank), group=g)

        self._run(what, group, call, 0 if out is not None else size, (n - 1) * size if out is not None else 0,
                  world=group is None, messages=n - 1 if out is not None else 0)
        return out

    def gather_objects(self, obj: Any, dst_group_rank: int, group: Any, what: str) -> Optional[list]:
        """One picklable object per rank of ``group`` on its rank ``dst_group_rank`` (None elsewhere)."""
        n = group_size(group)
        if not _distributed() or n == 1:
            return [obj]
        me = group_rank(group)
        out: Optional[list] = [None] * n if me == dst_group_rank else None
        size = len(pickle.dumps(obj))

        def call(g: Any) -> None:
            dst = self._global(group, g, dst_group_rank)
            dist.gather_object(obj, out, dst=dst, group=g)

        self._run(what, group, call, 0 if out is not None else size, 0, world=group is None,
                  messages=n - 1 if out is not None else 0)
        if out is not None:  # what the writer received: every other rank's pickle
            self.counter.received_bytes += sum(len(pickle.dumps(o)) for i, o in enumerate(out) if i != me)
        return out

    def broadcast_object(self, obj: Any, src_group_rank: int, group: Any, what: str) -> Any:
        """The object of rank ``src_group_rank`` of ``group`` on every rank of it."""
        if not _distributed() or group_size(group) == 1:
            return obj
        me = group_rank(group)
        box = [obj if me == src_group_rank else None]

        def call(g: Any) -> None:
            dist.broadcast_object_list(box, src=self._global(group, g, src_group_rank), group=g,
                                       device=group_device(group))

        self._run(what, group, call, 0, 0, world=group is None, messages=0 if me == src_group_rank else 1)
        size = len(pickle.dumps(box[0]))
        if me == src_group_rank:
            self.counter.sent_bytes += size
        else:
            self.counter.received_bytes += size
        return box[0]

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int, group: Any, what: str) -> torch.Tensor:
        """In-place tensor broadcast from rank ``src_group_rank`` of ``group``; returns ``tensor``."""
        if not _distributed() or group_size(group) == 1:
            return tensor
        me = group_rank(group)
        size = _nbytes(tensor)

        def call(g: Any) -> None:
            dist.broadcast(tensor, src=self._global(group, g, src_group_rank), group=g)

        self._run(what, group, call, size if me == src_group_rank else 0, 0 if me == src_group_rank else size,
                  world=group is None, messages=0 if me == src_group_rank else 1)
        return tensor

    def barrier(self, group: Any, what: str) -> None:
        """Every rank of ``group`` has arrived (mechmon's copy of it, bounded by the timeout)."""
        if not _distributed() or group_size(group) == 1:
            return
        self._run(what, group, lambda g: dist.barrier(group=g), 0, 0, world=group is None)

    def host_collective(self, fn: Callable[[], T], what: str) -> T:
        """A collective the host issues on its own groups for the monitors (ZeRO reads, the forced
        parameter all-gather): run, timed, and re-raised with ``what`` named. It runs whatever the
        down state (every rank must issue the same host collectives); its wait is the host's timeout."""
        start = time.perf_counter()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 -- named and re-raised for the failure log
            raise RuntimeError(f"{what} (the host's collective) failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self.counter.seconds += time.perf_counter() - start

    # ---------------------------------------------------------------- the end-of-step agreement
    def agree_up(self) -> bool:
        """Every rank: True when mechmon's collectives are on everywhere (one int32 all-reduce over
        the whole job); False on every rank when any rank is down. A rank whose failure was on the
        whole-job group itself cannot take part: its peers then time out here and are down too."""
        if not _distributed() or group_size(None) == 1:
            return self.down is None
        if self.down is not None and self.world_broken:
            return False
        flag = torch.tensor([0 if self.down is not None else 1], dtype=torch.int32, device=group_device(None))

        def call(g: Any) -> None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g)

        try:
            if self.down is None:
                self._run("the end-of-step agreement on the monitors' collectives", None, call, 4, 4, world=True)
            else:  # down on a sub-group only: the whole-job group is still in step, tell the peers
                call(self.own(None))
        except CollectiveFailure:
            return False
        except Exception as exc:  # noqa: BLE001 -- the peers time out here as well
            self.down = self.down or f"the end-of-step agreement: {type(exc).__name__}: {exc}"
            self.world_broken = True
            return False
        if not flag.item() and self.down is None:
            self.down = "a peer rank's monitor collective failed or timed out"
        return bool(flag.item())


_GUARD = CollectiveGuard()


def guard() -> CollectiveGuard:
    """This process's :class:`CollectiveGuard`. Looked up once per host, where it builds its
    communicator and session; the session, the communicators and the sites receive it from there."""
    return _GUARD


def reset_guard(timeout_s: float = DEFAULT_TIMEOUT_S) -> CollectiveGuard:
    """A fresh guard for this process (tests that build several jobs in one process)."""
    global _GUARD
    _GUARD = CollectiveGuard(timeout_s)
    return _GUARD
