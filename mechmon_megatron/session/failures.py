"""Monitor failures: caught on the rank where they happen, agreed on by every rank at the next check.

A monitor must never kill or hang training. Every phase of a check (reads and gathers, snapshot
copies, kernels, router summaries, the decision, the writers) runs through :meth:`FailureLog.run`,
which catches the exception, counts it (``mechmon/errors``), logs it with rank, phase and layer,
and keeps a :class:`PhaseFailure` record. The records travel with the rank's payload to the writer
in the gather that every check already does, and the writer's verdict returns to every rank in
the decision broadcast. So every rank takes the same branch: training goes on, or -- with
``--mechmon-strict`` -- every rank raises the same :class:`MechmonStrictError` at the same
iteration, also when the launcher would not tear the job down (srun without torchrun).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

FAILED: Any = type("Failed", (), {"__repr__": lambda self: "<mechmon: phase failed>"})()
"""Returned by :meth:`FailureLog.run` instead of the function's value when it raised."""


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

    def run(self, phase: str, layer: Optional[int], iteration: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or :data:`FAILED` after recording the exception (never raises)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 -- a monitor must never kill training on its own
            self.record(phase, layer, iteration, exc)
            return FAILED

    def record(self, phase: str, layer: Optional[int], iteration: int, exc: BaseException) -> PhaseFailure:
        failure = PhaseFailure(self.rank, int(iteration), phase, layer, f"{type(exc).__name__}: {exc}")
        self.errors += 1
        self.pending.append(failure)
        then = ("--mechmon-strict: every rank stops at this check" if self.strict
                else "counted in mechmon/errors; training goes on")
        logger.error("[mechmon] monitor failure (%s): %s", then, failure.describe(), exc_info=exc)
        return failure

    def take(self) -> list[PhaseFailure]:
        """The failures since the last call (they travel with this check's payload)."""
        out, self.pending = self.pending, []
        return out
