"""Read ``mechmon_alert.json`` after an abort and check that this run wrote it.

The session writes the alert into the abort checkpoint's folder (``iter_0000012/`` for the
megatron hosts, the DeepSpeed tag folder), or into ``--save`` itself when it had no checkpoint
folder. An alert is this run's when this launch wrote it (new or rewritten since the launch
began), its ``checkpoint_dir`` is the folder it lies in, and that folder's iteration is the alert's.
The file is read by the session's own reader (``AlertReport.from_json``), so the two never disagree
about its keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from mechmon_megatron.session.alert import ALERT_FILENAME, Alert, AlertReport
from mechmon_megatron.supervise.checkpoints import list_checkpoints


class AlertError(ValueError):
    """No usable alert for this run (missing, corrupt, or another run's)."""


@dataclass(frozen=True)
class AlertInfo:
    """This launch's alert report, where it lies, and what the supervisor derives from it."""

    report: AlertReport
    path: str

    @property
    def alert(self) -> Alert:
        """The alarm the supervisor answers: the report's first (the one at the top of the file)."""
        return self.report.alerts[0]

    @property
    def iteration(self) -> int:
        """The iteration of the abort (and of its checkpoint)."""
        return self.report.iteration

    @property
    def family(self) -> str:
        return self.alert.family

    @property
    def first_warning_step(self) -> Optional[int]:
        return self.alert.first_warning_step

    @property
    def change_point(self) -> int:
        """The detector's first-warning step; the alarm's iteration when it has none."""
        return self.iteration if self.first_warning_step is None else self.first_warning_step

    def to_json(self) -> dict:
        """The alert as the recovery records show it (``mechmon_recovery.jsonl``: ``alert``)."""
        return {"family": self.family, "layers": list(self.alert.layers), "heads": list(self.alert.heads),
                "iteration": self.iteration, "first_warning_step": self.first_warning_step, "file": self.path}


def _candidates(save: str) -> list[str]:
    """The alert in ``save`` and in each folder directly under it, finished checkpoint or not: an
    old alert in a folder that was not yet a finished checkpoint before the launch must still be
    seen as old after it."""
    paths = [os.path.join(save, ALERT_FILENAME)]
    try:
        paths += [os.path.join(entry.path, ALERT_FILENAME) for entry in os.scandir(save) if entry.is_dir()]
    except OSError:
        pass
    return [p for p in paths if os.path.isfile(p)]


def alert_files(save: str) -> dict[str, int]:
    """Every alert under ``save`` -> its modification time (ns): taken before each launch, so
    that only an alert this launch wrote (new or rewritten) counts as its own."""
    return {p: os.stat(p).st_mtime_ns for p in _candidates(save)}


def new_alert_path(save: str, before: dict[str, int]) -> Optional[str]:
    """The newest alert written since ``before`` (``alert_files`` at the launch), or None."""
    now = alert_files(save)
    fresh = [p for p, mtime in now.items() if before.get(p) != mtime]
    return max(fresh, key=lambda p: now[p]) if fresh else None


def read_alert(save: str, before: dict[str, int]) -> AlertInfo:
    """This launch's alert, or ``AlertError`` with one sentence naming the file."""
    path = new_alert_path(save, before)
    if path is None:
        old = list(alert_files(save))
        if old:
            raise AlertError(f"{max(old, key=os.path.getmtime)} is from another run: it was written before this "
                             "launch, and this launch wrote no alert")
        raise AlertError(f"no {ALERT_FILENAME} under {save} (the command exited with the abort code but wrote "
                         "no alert)")
    try:
        with open(path, encoding="utf-8") as f:
            report = AlertReport.from_json(json.load(f))
        if not report.alerts:
            raise ValueError("no alert in it")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AlertError(f"{path} is corrupt ({type(exc).__name__}: {exc})") from None
    folder = os.path.dirname(os.path.abspath(path))
    recorded = report.checkpoint_dir
    if recorded and os.path.realpath(recorded) != os.path.realpath(folder):
        raise AlertError(f"{path} is from another run: its checkpoint_dir {recorded} is not {folder}")
    folder_iteration = _folder_iteration(save, folder)
    if folder_iteration is not None and folder_iteration != report.iteration:
        raise AlertError(f"{path} is from another run: iteration {report.iteration} in a folder of iteration "
                         f"{folder_iteration}")
    return AlertInfo(report=report, path=path)


def _folder_iteration(save: str, folder: str) -> Optional[int]:
    for ckpt in list_checkpoints(save):
        if os.path.realpath(ckpt.path) == os.path.realpath(folder):
            return ckpt.iteration
    return None
