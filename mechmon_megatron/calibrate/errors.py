"""The one error of the calibration's user-facing side."""

from __future__ import annotations

__all__ = ["CalibrationError"]


class CalibrationError(ValueError):
    """Input the calibration cannot use: a path that holds no records, records of another
    interval, runs too short to fit a family, an output path it must not overwrite. The message
    is one line that names the path, family or flag and what to do; ``mechmon-calibrate`` prints it
    and exits with status 2 (no traceback)."""
