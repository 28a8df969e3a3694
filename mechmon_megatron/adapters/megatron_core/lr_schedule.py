"""The learning-rate schedule of a Megatron job, as the early-phase correction compares it.

The phase moments of a calibration hold for one warm-up length, decay style and peak learning rate
(``detect/phase_moments.py``); this reads the three from Megatron's arguments (Megatron-LM's
``get_args()``, or the example trainer's, which use the same names).
"""

from __future__ import annotations

from typing import Any, Optional

from mechmon_megatron.detect.phase_moments import TrainingSchedule

__all__ = ["schedule_of_args"]


def schedule_of_args(args: Any) -> Optional[TrainingSchedule]:
    """``TrainingSchedule(warm-up steps, --lr-decay-style, --lr)`` of Megatron's arguments (a peak
    learning rate of None when ``--lr`` is not set); None when they do not say it in steps (no
    ``lr_decay_style``, or a sample-based schedule, ``--train-samples``). ``--lr-warmup-fraction``
    counts, as in Megatron, as that share of the decay steps (``--lr-decay-iters``, else
    ``--train-iters``)."""
    style = getattr(args, "lr_decay_style", None)
    if not style or getattr(args, "train_samples", None):
        return None
    lr = getattr(args, "lr", None)
    peak_lr = float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 else None
    fraction = getattr(args, "lr_warmup_fraction", None)
    if fraction is not None:
        decay = getattr(args, "lr_decay_iters", None) or getattr(args, "train_iters", None)
        if not decay:
            return None
        return TrainingSchedule(round(fraction * decay), str(style), peak_lr)  # 0.29 * 100 is 28.999...
    return TrainingSchedule(int(getattr(args, "lr_warmup_iters", 0) or 0), str(style), peak_lr)
