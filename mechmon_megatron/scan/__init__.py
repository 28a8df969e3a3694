"""mechmon-scan: the online monitors and detector, replayed over a run's saved checkpoints.

Usage (docs/SCAN.md)::

    mechmon-scan RUN_DIR --out scan_out [--layers 1,3] [--every K] [--window K] [--false-alarm-rate R]

    from mechmon_megatron.scan import ScanConfig, run_scan
    summary = run_scan(ScanConfig(inputs=("runs/ckpt",), out="scan_out"))
    summary["first_anomaly"]  # None or {"after_iteration", "before_iteration", "family", "layer", "heads"}

Layout: ``readers/`` one file per checkpoint format (the only files that know a format);
``series`` / ``schedule`` find the checkpoints and the pairs; ``pairs`` runs the session's
checks on one layer of one pair; ``replay`` runs the session's detector over the checks;
``outputs/`` writes TensorBoard, the summary and the HTML report; ``runner`` ties them together.
"""

from __future__ import annotations

from typing import Any

from mechmon_megatron.scan.config import ScanConfig
from mechmon_megatron.scan.errors import ScanInputError

__all__ = ["ScanConfig", "ScanInputError", "main", "run_scan"]


def run_scan(config: ScanConfig) -> dict[str, Any]:
    """Scan a checkpoint series; returns the summary (also ``config.out/summary.json``)."""
    from mechmon_megatron.scan.runner import run_scan as _run

    return _run(config)


def main(argv: Any = None) -> int:
    from mechmon_megatron.scan.cli import main as _main

    return _main(argv)
