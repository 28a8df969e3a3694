"""Read ``mechmon_alert.json`` after an abort and check that this run wrote it.

The session writes the alert into the abort checkpoint's folder (``iter_0000012/`` for the
megatron hosts, the DeepSpeed tag folder), or into ``--save`` itself when it had no checkpoint
folder. An alert is this run's when it was written after the launch, its ``checkpoint_dir`` is
the folder it lies in, and that folder's iteration is the alert's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from mechmon_megatron.session.alert import ALERT_FILENAME
from mechmon_megatron.supervise.checkpoints import list_checkpoints

CLOCK_SLACK_S = 2.0
"""File times on a shared file system may lag our clock by this much (seconds)."""


class AlertError(ValueError):
    """No usable alert for this run (missing, corrupt, or another run's)."""


@dataclass(frozen=True)
class AlertInfo:
    iteration: int
    family: str
    first_warning_step: Optional[int]
    layers: list[int] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    action: str = ""
    exit_code: Optional[int] = None
    path: str = ""

    @property
    def change_point(self) -> int:
        """The detector's first-warning step; the alarm's iteration when it has none."""
        return self.iteration if self.first_warning_step is None else self.first_warning_step

    def to_json(self) -> dict:
        return {"family": self.family, "layers": self.layers, "heads": self.heads, "iteration": self.iteration,
                "first_warning_step": self.first_warning_step, "file": self.path}


def _candidates(save: str) -> list[str]:
    paths = [os.path.join(save, ALERT_FILENAME)]
    paths += [os.path.join(c.path, ALERT_FILENAME) for c in list_checkpoints(save)]
    return [p for p in paths if os.path.isfile(p)]


def newest_alert_path(save: str, since: Optional[float] = None) -> Optional[str]:
    """The most recently written alert under ``save`` (written after ``since``, a time.time())."""
    paths = _candidates(save)
    if since is not None:
        paths = [p for p in paths if os.path.getmtime(p) >= since - CLOCK_SLACK_S]
    return max(paths, key=os.path.getmtime) if paths else None


def read_alert(save: str, started_at: float) -> AlertInfo:
    """This run's alert, or ``AlertError`` with one sentence naming the file."""
    path = newest_alert_path(save)
    if path is None:
        raise AlertError(f"no {ALERT_FILENAME} under {save} (the command exited with the abort code but wrote no alert)")
    if os.path.getmtime(path) < started_at - CLOCK_SLACK_S:
        raise AlertError(f"{path} is from another run: it was written before this launch")
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        iteration = int(body["iteration"])
        family = body["family"]
        if not isinstance(family, str) or not family:
            raise ValueError("no family")
        first = body.get("first_warning_step")
        first = None if first is None else int(first)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AlertError(f"{path} is corrupt ({type(exc).__name__}: {exc})") from None
    folder = os.path.dirname(os.path.abspath(path))
    recorded = body.get("checkpoint_dir")
    if recorded and os.path.realpath(recorded) != os.path.realpath(folder):
        raise AlertError(f"{path} is from another run: its checkpoint_dir {recorded} is not {folder}")
    folder_iteration = _folder_iteration(save, folder)
    if folder_iteration is not None and folder_iteration != iteration:
        raise AlertError(f"{path} is from another run: iteration {iteration} in a folder of iteration {folder_iteration}")
    return AlertInfo(iteration=iteration, family=family, first_warning_step=first,
                     layers=[int(x) for x in body.get("layers") or []], heads=[int(x) for x in body.get("heads") or []],
                     action=str(body.get("action", "")), exit_code=body.get("exit_code"), path=path)


def _folder_iteration(save: str, folder: str) -> Optional[int]:
    for ckpt in list_checkpoints(save):
        if os.path.realpath(ckpt.path) == os.path.realpath(folder):
            return ckpt.iteration
    return None
