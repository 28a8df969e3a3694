"""What one scan reads and computes: :class:`ScanConfig`, validated once (errors name the flag)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal, Optional

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.scan.errors import ScanInputError

__all__ = ["ScanConfig"]


@dataclass(kw_only=True, slots=True)
class ScanConfig:
    """One scan of a checkpoint series (every field is a ``mechmon-scan`` flag)."""

    inputs: tuple[str, ...]
    """Run directories (a folder of checkpoints) and/or checkpoint directories / files."""

    out: str
    """Output directory (``--out``): TensorBoard events, ``summary.json``, ``report.html``, cache."""

    layers: Optional[tuple[int, ...]] = None
    """Global 1-based layer numbers to scan (``--layers``); None: every layer with Q/K weights."""

    every: int = 1
    """Judge every k-th checkpoint only (``--every``): checks are ``every`` checkpoints apart."""

    window: int = 1
    """Compare checkpoint t with checkpoint t - window (``--window``, in checkpoints): the
    increment window is ``window`` x the save interval in steps."""

    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE
    """Expected false alarms per 10^6 training steps for the whole scan (``--false-alarm-rate``),
    as the online ``--mechmon-false-alarm-rate``."""

    detector_calibration: Optional[str] = None
    """A null-tail table of your own healthy runs (``--detector-calibration``,
    ``tools/calibrate_detector.py``); default: the shipped table."""

    alpha: float = 2.0
    """Spectral-entropy exponent (``--alpha``), as ``--mechmon-alpha``."""

    qk_method: Literal["gram", "compressed"] = "gram"
    """Kernel of the per-head Delta spectra (``--qk-method``), as ``--mechmon-qk-method``."""

    num_attention_heads: Optional[int] = None
    """Query heads per layer (``--num-attention-heads``) when the checkpoint does not record it."""

    num_query_groups: Optional[int] = None
    """Key/value groups (``--num-query-groups``); default: from the checkpoint, else MHA."""

    kv_channels: Optional[int] = None
    """Head dimension (``--kv-channels``); default: from the checkpoint, else Q rows / heads."""

    progress: bool = True
    """Show a tqdm progress bar (checkpoints x layers) on stderr when it is a terminal."""

    def __post_init__(self) -> None:
        self.inputs = tuple(str(p) for p in self.inputs)
        if not self.inputs:
            raise ScanInputError("mechmon-scan needs at least one RUN_DIR_OR_CHECKPOINT argument.")
        if not self.out:
            raise ScanInputError("--out must name an output directory.")
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ScanInputError(f"--out {self.out!r} exists and is not a directory.")
        for flag, value in (("--every", self.every), ("--window", self.window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScanInputError(f"{flag} must be an integer >= 1 (checkpoints), got {value!r}.")
        rate = self.false_alarm_rate
        number = isinstance(rate, (int, float)) and not isinstance(rate, bool)
        if not (number and math.isfinite(rate) and 0 < rate <= 1e6):
            raise ScanInputError(
                f"--false-alarm-rate must be a number in (0, 1e6] (false alarms per 10^6 steps), got {rate!r}."
            )
        if self.detector_calibration is not None and not os.path.isfile(self.detector_calibration):
            raise ScanInputError(
                f"--detector-calibration {self.detector_calibration!r} is not a file "
                "(expected a null-tail JSON written by tools/calibrate_detector.py)."
            )
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ScanInputError(f"--alpha must be a number > 0, got {self.alpha!r}.")
        if self.qk_method not in ("gram", "compressed"):
            raise ScanInputError(f"--qk-method must be gram or compressed, got {self.qk_method!r}.")
        if self.layers is not None:
            self.layers = tuple(sorted(set(self.layers)))
            if not self.layers or any(isinstance(L, bool) or not isinstance(L, int) or L < 1 for L in self.layers):
                raise ScanInputError(f"--layers must be global 1-based layer numbers, got {self.layers!r}.")
        for flag, count in (
            ("--num-attention-heads", self.num_attention_heads),
            ("--num-query-groups", self.num_query_groups),
            ("--kv-channels", self.kv_channels),
        ):
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
                raise ScanInputError(f"{flag} must be a positive integer, got {count!r}.")
        if self.num_attention_heads and self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            raise ScanInputError(
                f"--num-attention-heads {self.num_attention_heads} must be a multiple of --num-query-groups "
                f"{self.num_query_groups}."
            )
