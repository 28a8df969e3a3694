"""Scalar writers: one tiny contract (``write_scalars`` + ``flush`` + ``close``), one class each.

The session decides which rank writes; writers never check ranks themselves.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Protocol

from mechmon_megatron.session.runs import RUN_KEY, RUNS_FILE, RunMarker, last_record, run_of, utc_now


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
    """One JSON object per check: ``{"step": t, "scalars": {...}}`` -- easy to read back in tools.

    After :meth:`start_run` each row also carries its run number (``"run"``, ``session/runs.py``),
    so that a fresh start appended to a used file stays apart from the run before it."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.run: Optional[int] = None
        self._file = open(path, "a", encoding="utf-8")

    def start_run(self, run_id: str, start_iteration: int, resumed: bool, interval: int,
                  delta: int) -> RunMarker:
        """Number this launch's rows and append its marker to ``mechmon_runs.jsonl`` beside the file.

        A resume (monitor state loaded) continues the last run in the file; a fresh start begins
        the next one when the file already holds records (run 1 otherwise)."""
        last = last_record(self.path)
        previous = run_of(last) if last is not None else None
        run = (previous or 1) if resumed else (previous or 0) + 1
        marker = RunMarker(run=run, run_id=run_id, start_iteration=int(start_iteration), resumed=bool(resumed),
                           interval=int(interval), delta=int(delta), started=utc_now(), previous_run=previous)
        with open(os.path.join(os.path.dirname(os.path.abspath(self.path)), RUNS_FILE), "a", encoding="utf-8") as f:
            f.write(marker.to_json() + "\n")
        self.run = run
        return marker

    def write_scalars(self, scalars: dict[str, float], step: int) -> None:
        row: dict[str, Any] = {"step": step, "scalars": scalars}
        if self.run is not None:
            row[RUN_KEY] = self.run
        self._file.write(json.dumps(row, allow_nan=True) + "\n")

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

    def start_run(self, run_id: str, start_iteration: int, resumed: bool, interval: int,
                  delta: int) -> Optional[RunMarker]:
        """Start the run of every writer that numbers runs (the JSONL records); the first one's
        marker, or None when no writer keeps records."""
        markers = [writer.start_run(run_id, start_iteration, resumed, interval, delta)
                   for writer in self.writers if isinstance(writer, JsonlScalarWriter)]
        return markers[0] if markers else None

    def flush(self) -> None:
        _each(self.writers, "flush")

    def close(self) -> None:
        _each(self.writers, "close")


def _each(writers: Iterable[ScalarWriter], method: str) -> None:
    """``writer.<method>()`` on every writer, then the first error: one failing writer (a full
    disk under the log dir) neither keeps the others from their records nor hides its failure."""
    first: Optional[BaseException] = None
    for writer in writers:
        try:
            getattr(writer, method)()
        except Exception as exc:  # noqa: BLE001 -- re-raised below, after the other writers
            first = first or exc
    if first is not None:
        raise first
