"""``<save>/mechmon_recovery.jsonl``: one JSON object a line per supervisor action.

Keys of every record: ``action`` (``relaunch`` or ``stop``), ``time`` (UTC, ISO 8601), ``reason``
(one sentence), ``launch`` (1-based number of the launch that just ended; 0 before the first),
``exit_code`` (of that launch, None before the first), ``restarts`` (relaunches so far, this one
included). A relaunch also has ``alert``, ``checkpoint`` (name, iteration, path), ``aborted`` (where
the abort checkpoint was moved: ``from``, ``to``, ``iteration``),
``after_change_point``, ``why`` (the selection), ``remedy``, ``flags_removed``, ``flags_added``,
``notes`` and ``command``. The same record goes to TensorBoard as text when the command has a
``--tensorboard-dir`` and ``torch.utils.tensorboard`` imports (never required).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

logger = logging.getLogger(__name__)
RECOVERY_FILENAME = "mechmon_recovery.jsonl"
TB_TAG = "mechmon/recovery"


@dataclass(kw_only=True)
class RecoveryRecord:
    action: Literal["relaunch", "stop"]
    reason: str
    launch: int
    exit_code: Optional[int]
    restarts: int
    time: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    elapsed_s: float = 0.0
    """Seconds since the supervisor started."""
    alert: Optional[dict] = None
    checkpoint: Optional[dict] = None
    aborted: Optional[dict] = None
    """The abort checkpoint kept aside before the relaunch: ``from``, ``to`` (under
    ``--save/mechmon_aborted/launch-N/``), ``iteration``."""
    after_change_point: bool = False
    why: str = ""
    remedy: Optional[str] = None
    flags_removed: list[str] = field(default_factory=list)
    flags_added: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)

    def line(self) -> str:
        """The one line printed for this action."""
        text = f"[mechmon-supervise] {self.action.upper()} after launch {self.launch}"
        if self.exit_code is not None:
            text += f" (exit {self.exit_code})"
        text += f": {self.reason}"
        if self.checkpoint is not None:
            text += f"; from {self.checkpoint['name']}"
            if self.after_change_point:
                text += " (saved AFTER the change point)"
        if self.aborted is not None:
            text += f"; abort checkpoint kept in {self.aborted['to']}"
        if self.remedy:
            text += f"; remedy {self.remedy}"
        if self.flags_added or self.flags_removed:
            text += f"; added {' '.join(self.flags_added) or '-'}; removed {' '.join(self.flags_removed) or '-'}"
        return text


class RecoveryLog:
    """Appends records to ``<save>/mechmon_recovery.jsonl`` (and TensorBoard text if asked)."""

    def __init__(self, save: Optional[str], tensorboard_dir: Optional[str] = None) -> None:
        self.path = os.path.join(save, RECOVERY_FILENAME) if save else None
        self._tb_dir = tensorboard_dir
        self._step = 0

    def append(self, record: RecoveryRecord) -> None:
        print(record.line(), flush=True)
        body = asdict(record)
        if self.path is not None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(body, default=str) + "\n")
        self._step += 1
        if self._tb_dir:
            self._tensorboard(record.line() + "\n\n```\n" + json.dumps(body, indent=1, default=str) + "\n```")

    def _tensorboard(self, text: str) -> None:
        """Best effort: a missing tensorboard never stops the supervisor."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # noqa: BLE001 -- optional dependency, any import failure means "off"
            logger.info("torch.utils.tensorboard not importable: recovery records not written to TensorBoard")
            self._tb_dir = None
            return
        writer = SummaryWriter(log_dir=self._tb_dir, filename_suffix=".mechmon_recovery")
        writer.add_text(TB_TAG, text, global_step=self._step)
        writer.close()
