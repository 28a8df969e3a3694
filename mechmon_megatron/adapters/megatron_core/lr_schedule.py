"""The learning-rate schedule of a Megatron job, as the early-phase correction compares it.

The phase moments of a calibration hold for one warm-up length and decay style
(``detect/phase_moments.py``); this reads both from Megatron's arguments (Megatron-LM's
``get_args()``, or the example trainer's, which use the same names).
"""

from __future__ import annotations

from typing import Any, Optional

from mechmon_megatron.detect.phase_moments import TrainingSchedule

__all__ = ["schedule_of_args"]


def schedule_of_args(args: Any) -> Optional[TrainingSchedule]:
    """``TrainingSchedule(warm-up steps, --lr-decay-style)`` of Megatron's arguments; None when
    they do not say it in steps (no ``lr_decay_style``, or a sample-based schedule,
    ``--train-samples``). ``--lr-warmup-fraction`` counts, as in Megatron, as that share of the
    decay steps (``--lr-decay-iters``, else ``--train-iters``)."""
    style = getattr(args, "lr_decay_style", None)
    if not style or getattr(args, "train_samples", None):
        return None
    fraction = getattr(args, "lr_warmup_fraction", None)
    if fraction is not None:
        decay = getattr(args, "lr_decay_iters", None) or getattr(args, "train_iters", None)
        if not decay:
            return None
        return TrainingSchedule(round(fraction * decay), str(style))  # 0.29 * 100 is 28.999...
    return TrainingSchedule(int(getattr(args, "lr_warmup_iters", 0) or 0), str(style))
