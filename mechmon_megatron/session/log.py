"""mechmon's log lines: the ``[mechmon]`` prefix added in one place, and a line written on one rank only.

Like megatron-core's ``log_single_rank``::

    log = mechmon_log(__name__)
    log.warning("no output: ... %s", where)          # "[mechmon] no output: ..." on every rank
    log.info("monitoring %d layers", n, rank=0)      # on global rank 0 only

Each module keeps its own logger, a child of the package logger ``mechmon_megatron`` (so one
setting there covers them all, and a host's or a test's setting for one module still applies);
the session and its pieces write under the session's one name, :data:`SESSION`. :func:`log`
writes through the package logger itself. ``rank``: the global rank (``torch.distributed``'s
default group) that writes the line; None: every rank. Before the process group exists every
process counts as rank 0.

Standard library only: the supervisor loads it (through ``session.alert`` and ``session.webhook``),
and it never imports torch (it asks ``torch.distributed`` only when the process already loaded it).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

__all__ = ["PACKAGE", "PREFIX", "SESSION", "MechmonLog", "global_rank", "log", "mechmon_log"]

PREFIX = "[mechmon]"
"""What every mechmon line starts with (added here, never spelled by a caller)."""
PACKAGE = "mechmon_megatron"
"""The package logger: every module's logger is a child of it."""
SESSION = "mechmon_megatron.session.session"
"""The logger of the monitoring session and of its pieces (checks, exchange, decision, start-up lines)."""


def global_rank() -> int:
    """This process's rank in ``torch.distributed``'s default group (0 before it exists, or without torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return int(dist.get_rank())


class MechmonLog:
    """A module's logger that adds :data:`PREFIX` and can keep a line to one rank."""

    def __init__(self, name: str = PACKAGE) -> None:
        self.logger = logging.getLogger(name)

    def log(self, level: int, message: str, *args: Any, rank: Optional[int] = None, exc_info: Any = None) -> None:
        """``[mechmon] message % args`` at ``level``; only on global rank ``rank`` when it is given."""
        self._write(level, message, args, rank, exc_info)

    def debug(self, message: str, *args: Any, rank: Optional[int] = None, exc_info: Any = None) -> None:
        self._write(logging.DEBUG, message, args, rank, exc_info)

    def info(self, message: str, *args: Any, rank: Optional[int] = None, exc_info: Any = None) -> None:
        self._write(logging.INFO, message, args, rank, exc_info)

    def warning(self, message: str, *args: Any, rank: Optional[int] = None, exc_info: Any = None) -> None:
        self._write(logging.WARNING, message, args, rank, exc_info)

    def error(self, message: str, *args: Any, rank: Optional[int] = None, exc_info: Any = None) -> None:
        self._write(logging.ERROR, message, args, rank, exc_info)

    def _write(self, level: int, message: str, args: tuple, rank: Optional[int], exc_info: Any) -> None:
        if rank is not None and global_rank() != rank:
            return
        if self.logger.isEnabledFor(level):
            # stacklevel 3: the record names the caller of debug/info/warning/error/log, not this file
            self.logger.log(level, f"{PREFIX} {message}", *args, exc_info=exc_info, stacklevel=3)


def mechmon_log(name: str = PACKAGE) -> MechmonLog:
    """The prefixed, rank-aware logger of module ``name`` (``__name__``)."""
    return MechmonLog(name)


_PACKAGE_LOG = MechmonLog(PACKAGE)


def log(level: int, message: str, *args: Any, rank: Optional[int] = None, exc_info: Any = None) -> None:
    """``[mechmon] message % args`` through the package logger; only on global rank ``rank`` when given."""
    _PACKAGE_LOG._write(level, message, args, rank, exc_info)
