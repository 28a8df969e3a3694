"""The end-of-step agreement: are every rank's monitor collectives still up?

At the end of a step with monitor collectives every rank takes part in one all-reduce
(``CollectiveGuard.agree_up``). When some rank's collective failed or timed out, the monitors turn
off on every rank at that step, training goes on unwatched and the error line says so -- or, under
``--mechmon-strict``, every rank stops with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mechmon_megatron.session.collective_guard import CollectiveGuard
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.log import SESSION, mechmon_log

log = mechmon_log(SESSION)


@dataclass(frozen=True)
class MonitorsOff:
    """The agreement failed: ``cause`` (this rank's view of it); ``stop``: under
    ``--mechmon-strict``, the message every rank raises (None: training goes on unwatched)."""

    cause: str
    stop: Optional[str] = None


def agree_collectives(guard: CollectiveGuard, config: MechmonConfig, rank: int,
                      iteration: int) -> Optional[MonitorsOff]:
    """None when every rank's monitor collectives are up; else why not, and whether every rank stops."""
    if guard.agree_up():
        return None
    timeout = guard.timeout_s
    cause = guard.down or "a peer rank's monitor collective failed or timed out"
    if config.strict:
        return MonitorsOff(cause, stop=(
            f"mechmon monitor failed and --mechmon-strict is set; every rank stops: a monitor collective "
            f"failed or timed out at iteration {iteration} (--mechmon-collective-timeout {timeout:g} s); "
            f"on rank {rank}: {cause}"))
    log.error(
        "a monitor collective failed or timed out at iteration %d (--mechmon-collective-timeout %g s): "
        "the monitors are off on every rank from now on (on rank %d: %s). Training goes on, NOT watched "
        "(mechmon/active = 0); training's own communicators were not used; --mechmon-strict stops the job "
        "instead", iteration, timeout, rank, cause)
    return MonitorsOff(cause)
