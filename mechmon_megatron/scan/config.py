"""What one scan reads and computes: :class:`ScanConfig`, validated once (errors name the flag)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Optional

from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.detect.phase_moments import TrainingSchedule
from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.session.config import MechmonConfig, default_of, flag_of
from mechmon_megatron.session.startup import directory_problem

__all__ = ["SHARED_SETTINGS", "ScanConfig", "scan_error", "scan_flag"]

SHARED_SETTINGS = ("false_alarm_rate", "detector_calibration", "alpha", "qk_method")
"""The ``MechmonConfig`` fields the scan offers as its own flags (``--alpha``: the same help,
default, type and checks as ``--mechmon-alpha``), in the order of its ``--help``."""


def scan_flag(name: str) -> str:
    """How the scan spells a setting: its own flag (``--alpha``) for the settings it shares with
    the online session, the session's flag (``--mechmon-short-window``) for the others."""
    return "--" + name.replace("_", "-") if name in SHARED_SETTINGS else flag_of(name)


def scan_error(exc: ConfigError) -> ScanInputError:
    """A session's refusal, in the scan's flag names."""
    return ScanInputError(exc.render(scan_flag))


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

    false_alarm_rate: float = default_of("false_alarm_rate")
    """Expected false alarms per 10^6 training steps for the whole scan (``--false-alarm-rate``),
    as the online ``--mechmon-false-alarm-rate``."""

    detector_calibration: Optional[str] = None
    """A null-tail table of your own healthy runs (``--detector-calibration``,
    ``mechmon-calibrate``); default: the shipped table."""

    alpha: float = default_of("alpha")
    """Spectral-entropy exponent (``--alpha``), as ``--mechmon-alpha``."""

    qk_method: Literal["gram", "compressed"] = default_of("qk_method")
    """Kernel of the per-head Delta spectra (``--qk-method``), as ``--mechmon-qk-method``."""

    num_attention_heads: Optional[int] = None
    """Query heads per layer (``--num-attention-heads``) when the checkpoint does not record it."""

    num_query_groups: Optional[int] = None
    """Key/value groups (``--num-query-groups``); default: from the checkpoint, else MHA."""

    kv_channels: Optional[int] = None
    """Head dimension (``--kv-channels``); default: from the checkpoint, else Q rows / heads."""

    qk_head_dim: Optional[int] = None
    """Multi-head latent attention: no-RoPE query/key channels per head (``--qk-head-dim``);
    default: from the checkpoint, else from the shapes."""

    qk_pos_emb_head_dim: Optional[int] = None
    """MLA: RoPE query/key channels per head (``--qk-pos-emb-head-dim``); default: from the
    checkpoint, else the key/value down projection's rows beyond the latent."""

    v_head_dim: Optional[int] = None
    """MLA: value channels per head (``--v-head-dim``); default: from the checkpoint, else the
    key/value up projection's rows per head beyond the key rows."""

    normalization: Optional[Literal["LayerNorm", "RMSNorm"]] = None
    """Kind of the QK-norms and MLA latent norms (``--normalization``); default: from the
    checkpoint, else RMSNorm."""

    apply_layernorm_1p: bool = False
    """The norms store ``gamma - 1`` (``--apply-layernorm-1p``, megatron-core's
    ``layernorm_zero_centered_gamma``); default: from the checkpoint, else a plain gamma."""

    progress: bool = True
    """Show a tqdm progress bar (checkpoints x layers) on stderr when it is a terminal."""

    lr_schedule: Optional[TrainingSchedule] = None
    """The scanned run's learning-rate schedule (``--lr-warmup-iters``, ``--lr-decay-style``, ``--lr``),
    which the early-phase correction compares with its calibration's; None: the correction is off
    (``summary.json`` notes say why)."""

    def __post_init__(self) -> None:
        self.inputs = tuple(str(p) for p in self.inputs)
        if not self.inputs:
            raise ScanInputError("mechmon-scan needs at least one RUN_DIR_OR_CHECKPOINT argument.")
        if not self.out:
            raise ScanInputError("--out must name an output directory.")
        problem = directory_problem(self.out)
        if problem:
            raise ScanInputError(f"--out {self.out!r} {problem}.")
        for flag, value in (("--every", self.every), ("--window", self.window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScanInputError(f"{flag} must be an integer >= 1 (checkpoints), got {value!r}.")
        if self.detector_calibration is not None and not os.path.isfile(self.detector_calibration):
            raise ScanInputError(
                f"--detector-calibration {self.detector_calibration!r} is not a file "
                "(expected a null-tail JSON written by mechmon-calibrate)."
            )
        # The values the online session shares are checked by the session's own rules: the scan
        # and the trainer accept and refuse the same --alpha, rate and kernel.
        try:
            MechmonConfig(enabled=True, alpha=self.alpha, false_alarm_rate=self.false_alarm_rate,
                          qk_method=self.qk_method, detector_calibration=self.detector_calibration)
        except ConfigError as exc:
            raise scan_error(exc) from None
        if self.layers is not None:
            self.layers = tuple(sorted(set(self.layers)))
            if not self.layers or any(isinstance(L, bool) or not isinstance(L, int) or L < 1 for L in self.layers):
                raise ScanInputError(f"--layers must be global 1-based layer numbers, got {self.layers!r}.")
        for flag, count in (
            ("--num-attention-heads", self.num_attention_heads),
            ("--num-query-groups", self.num_query_groups),
            ("--kv-channels", self.kv_channels),
            ("--qk-head-dim", self.qk_head_dim),
            ("--v-head-dim", self.v_head_dim),
        ):
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
                raise ScanInputError(f"{flag} must be a positive integer, got {count!r}.")
        rope = self.qk_pos_emb_head_dim
        if rope is not None and (isinstance(rope, bool) or not isinstance(rope, int) or rope < 0):
            raise ScanInputError(f"--qk-pos-emb-head-dim must be an integer >= 0, got {rope!r}.")
        if self.normalization not in (None, "LayerNorm", "RMSNorm"):
            raise ScanInputError(f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}.")
        if self.num_attention_heads and self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            raise ScanInputError(
                f"--num-attention-heads {self.num_attention_heads} must be a multiple of --num-query-groups "
                f"{self.num_query_groups}."
            )
