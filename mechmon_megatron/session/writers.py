"""Scalar writers: one tiny contract (``write_scalars`` + ``flush`` + ``close``), one class each.

The session decides which rank writes; writers never check ranks themselves.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Protocol


class ScalarWriter(Protocol):
    def write_scalars(self, scalars: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardScalarWriter:
    """Writes through any object with ``add_scalar(name, value, step)`` (TensorBoard's
    ``SummaryWriter``, Megatron's ``get_tensorboard_writer()``); ``owns`` = close it at the end."""

    def __init__(self, summary_writer: Any, owns: bool = False) -> None:
        self._writer = summary_writer
        self._owns = owns

    @classmethod
    def in_directory(cls, log_dir: str) -> TensorBoardScalarWriter:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is an optional dependency
            raise ImportError(
                "writing TensorBoard scalars needs the `tensorboard` package: pip install 'mechmon-megatron[test]'"
            ) from exc
        os.makedirs(log_dir, exist_ok=True)
        return cls(SummaryWriter(log_dir=log_dir), owns=True)

    def write_scalars(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, step)

    def flush(self) -> None:
        if hasattr(self._writer, "flush"):
            self._writer.flush()

    def close(self) -> None:
        self.flush()
        if self._owns:
            self._writer.close()


class WandbScalarWriter:
    """Writes through a W&B run (``wandb.log``-compatible object)."""

    def __init__(self, run: Any) -> None:
        self._run = run

    def write_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(dict(scalars), step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlScalarWriter:
    """One JSON object per check: ``{"step": t, "scalars": {...}}`` -- easy to read back in tools."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, "scalars": scalars}, allow_nan=True) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class EventListWriter:
    """Adapts an object with ``write_events([(name, value, step), ...])`` (DeepSpeed's monitor)."""

    def __init__(self, monitor: Any) -> None:
        self._monitor = monitor

    def write_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._monitor.write_events([(name, value, step) for name, value in scalars.items()])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class WriterGroup:
    """Fans out to several writers; an empty group writes nothing."""

    def __init__(self, writers: Optional[Iterable[ScalarWriter]] = None) -> None:
        self.writers: list[ScalarWriter] = list(writers or [])

    def write_scalars(self, scalars: dict[str, float], step: int) -> None:
        for writer in self.writers:
            writer.write_scalars(scalars, step)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
