"""The per-check scalars as the online session writes them: TensorBoard events (``mechmon/`` tags,
step = checkpoint iteration) and ``mechmon_scalars.jsonl`` (the session's JSONL writer; the input
of ``mechmon-calibrate``, so a scan of a healthy run can calibrate the detector)."""

from __future__ import annotations

from collections.abc import Sequence

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.replay import CheckValues
from mechmon_megatron.session.writers import JsonlScalarWriter, TensorBoardScalarWriter

__all__ = ["write_jsonl", "write_tensorboard"]


def write_tensorboard(log_dir: str, checks: Sequence[CheckValues]) -> None:
    """One event per scalar per check, through the session's own TensorBoard writer."""
    try:
        writer = TensorBoardScalarWriter.in_directory(log_dir)
    except ImportError as exc:
        raise ScanInputError(f"{exc} (needed for the scan's TensorBoard output)") from None
    try:
        for check in checks:
            writer.write_scalars(dict(sorted(check.scalars.items())), check.step)
    finally:
        writer.close()


def write_jsonl(path: str, checks: Sequence[CheckValues]) -> None:
    """One ``{"step": t, "scalars": {...}}`` line per check (``session.writers.JsonlScalarWriter``)."""
    writer = JsonlScalarWriter(path)
    try:
        for check in checks:
            writer.write_scalars(dict(sorted(check.scalars.items())), check.step)
    finally:
        writer.close()
