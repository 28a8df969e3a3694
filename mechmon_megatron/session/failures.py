"""Monitor failures: caught on the rank where they happen, agreed on by every rank at the next check.

A monitor must never kill or hang training. Every phase of a check (reads and gathers, snapshot
copies, kernels, router summaries, the decision, the writers) runs through :meth:`FailureLog.run`,
which catches the exception, counts it (``mechmon/errors``), logs it with rank, phase and layer,
and keeps a :class:`PhaseFailure` record; it returns the function's value or :data:`FAILED`
(typed :data:`Outcome`: a caller narrows it with ``is FAILED``). The records travel with the
rank's payload to the writer in the gather that every check already does, and the writer's
verdict returns to every rank in the decision broadcast. So every rank takes the same branch:
training goes on, or -- with ``--mechmon-strict`` -- every rank raises the same
:class:`MechmonStrictError` at the same iteration, also when the launcher would not tear the job
down (srun without torchrun).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any, Callable, Final, Literal, Optional, TypeVar, Union

from mechmon_megatron.session.collective_guard import CollectivesOff
from mechmon_megatron.session.log import mechmon_log

log = mechmon_log(__name__)

T = TypeVar("T")


class Failed(enum.Enum):
    """The type of :data:`FAILED` (one member: ``x is FAILED`` narrows ``Union[T, Failed]`` to ``T``)."""

    FAILED = "failed"

    def __repr__(self) -> str:
        return "<mechmon: phase failed>"


FAILED: Final = Failed.FAILED
"""Returned by :meth:`FailureLog.run` instead of the function's value when it raised."""

Outcome = Union[T, Literal[Failed.FAILED]]
"""What :meth:`FailureLog.run` returns: the function's value, or :data:`FAILED`."""


class MechmonStrictError(RuntimeError):
    """``--mechmon-strict``: a monitor phase failed on some rank; raised on every rank together."""


@dataclass(frozen=True)
class PhaseFailure:
    """One caught monitor failure. ``phase``: read, snapshot, kernel, router, payload, decision, write."""

    rank: int
    iteration: int
    phase: str
    layer: Optional[int]
    error: str

    def describe(self) -> str:
        where = f", layer {self.layer}" if self.layer is not None else ""
        return f"rank {self.rank}, iteration {self.iteration}, phase {self.phase}{where}: {self.error}"

    def to_dict(self) -> dict:
        return asdict(self)


def strict_stop_message(failures: list[PhaseFailure]) -> str:
    """The one message every rank raises under ``--mechmon-strict`` (root causes before the peers
    that only saw them: a ``PeerFailure`` is the echo of a failure on another rank)."""
    failures = sorted(failures, key=lambda f: f.error.startswith("PeerFailure"))
    shown = "; ".join(f.describe() for f in failures[:5])
    more = f" (+{len(failures) - 5} more)" if len(failures) > 5 else ""
    return (f"mechmon monitor failed and --mechmon-strict is set; every rank stops: {shown}{more}. "
            "Without --mechmon-strict these are counted in mechmon/errors and training goes on.")


class FailureLog:
    """Catches and records the failures of one rank between two decisions."""

    def __init__(self, rank: int, strict: bool) -> None:
        self.rank = rank
        self.strict = strict
        self.errors = 0
        self.pending: list[PhaseFailure] = []
        self.by_phase: dict[str, int] = {}
        """Failures of this process per phase (``write``: the records the writers lost)."""
        self.first_of_phase: dict[str, PhaseFailure] = {}
        self._logged: set[tuple[str, Optional[int], str]] = set()

    def run(self, phase: str, layer: Optional[int], iteration: int, fn: Callable[..., T], *args: Any) -> Outcome[T]:
        """``fn(*args)``, or :data:`FAILED` after recording the exception (never raises)."""
        try:
            return fn(*args)
        except CollectivesOff:  # skipped, not failed: the collective that failed was recorded once
            return FAILED
        except Exception as exc:  # noqa: BLE001 -- a monitor must never kill training on its own
            self.record(phase, layer, iteration, exc)
            return FAILED

    def record(self, phase: str, layer: Optional[int], iteration: int, exc: BaseException) -> PhaseFailure:
        failure = PhaseFailure(self.rank, int(iteration), phase, layer, f"{type(exc).__name__}: {exc}")
        self.errors += 1
        self.pending.append(failure)
        self.by_phase[phase] = self.by_phase.get(phase, 0) + 1
        self.first_of_phase.setdefault(phase, failure)
        then = ("--mechmon-strict: every rank stops at this check" if self.strict
                else "counted in mechmon/errors; training goes on")
        # The first of a kind with its traceback; a repeat at every check would bury the log (the
        # writer's one line per QUIET_REPORT_EVERY checks says that the monitors stay off).
        kind = (phase, layer, type(exc).__name__)
        if kind in self._logged:
            log.debug("monitor failure again (%s): %s", then, failure.describe())
        else:
            self._logged.add(kind)
            log.error("monitor failure (%s): %s", then, failure.describe(), exc_info=exc)
        return failure

    def take(self) -> list[PhaseFailure]:
        """The failures since the last call (they travel with this check's payload)."""
        out, self.pending = self.pending, []
        return out


QUIET_REPORT_EVERY = 10
"""While the monitors stay off, the writer repeats its error line every this many checks."""


class QuietMonitors:
    """The writer's account of checks at which the monitors did not run (the user must know).

    A check is active (``mechmon/active`` = 1) when the detector decided and no rank reported a
    failure. The first inactive check, and every :data:`QUIET_REPORT_EVERY`-th one in a row
    after it, logs one error line naming the cause; the first active check after them says so.
    """

    def __init__(self, every: int = QUIET_REPORT_EVERY) -> None:
        self.every = every
        self.quiet_checks = 0
        self.since: Optional[int] = None

    def update(self, iteration: int, failures: list[PhaseFailure]) -> bool:
        """Record this check; True when it was active."""
        if not failures:
            if self.quiet_checks:
                log.warning("monitors running again at iteration %d after %d checks without them",
                            iteration, self.quiet_checks)
            self.quiet_checks, self.since = 0, None
            return True
        if self.since is None:
            self.since = iteration
        if self.quiet_checks % self.every == 0:
            roots = sorted(failures, key=lambda f: f.error.startswith("PeerFailure"))
            log.error(
                "the monitors did not run at %d check(s) in a row (since iteration %d; mechmon/active = 0): "
                "%s%s. Training is NOT being watched; --mechmon-strict stops the job instead",
                self.quiet_checks + 1, self.since, roots[0].describe(),
                f" (+{len(roots) - 1} more at this check)" if len(roots) > 1 else "",
            )
        self.quiet_checks += 1
        return False
