"""The two flags that name a run's learning-rate schedule in the offline tools.

``mechmon-calibrate`` (the healthy runs it fits the phase moments on) and ``mechmon-scan`` (the run
whose checkpoints it judges) both take ``--lr-warmup-iters N --lr-decay-style S``, spelled as
Megatron spells them; the early-phase correction (``detect/phase_moments.py``) holds for one
schedule, so the two come together or not at all.
"""

from __future__ import annotations

import argparse
from typing import Optional

from mechmon_megatron.detect.phase_moments import TrainingSchedule

__all__ = ["add_schedule_flags", "schedule_from_args"]


def add_schedule_flags(parser: argparse.ArgumentParser, whose: str) -> None:
    """Add ``--lr-warmup-iters`` and ``--lr-decay-style``; ``whose``: "the runs'" or "the run's"."""
    parser.add_argument("--lr-warmup-iters", type=int, default=None,
                        help=f"{whose} learning-rate warm-up (steps); with --lr-decay-style, the early-phase "
                             "correction of young baselines")
    parser.add_argument("--lr-decay-style", default=None,
                        help=f"{whose} learning-rate decay (Megatron's --lr-decay-style: cosine, linear, WSD, ...)")


def schedule_from_args(args: argparse.Namespace) -> Optional[TrainingSchedule]:
    """The schedule the two flags name, or None when neither is given. ``ValueError`` naming the
    flags for one alone, a negative warm-up or an empty style."""
    warmup, style = args.lr_warmup_iters, args.lr_decay_style
    if warmup is None and style is None:
        return None
    if warmup is None or style is None:
        given, missing = ("--lr-warmup-iters", "--lr-decay-style") if style is None else (
            "--lr-decay-style", "--lr-warmup-iters")
        raise ValueError(f"{given} needs {missing} too (the phase moments hold for one schedule)")
    if warmup < 0:
        raise ValueError(f"--lr-warmup-iters must be >= 0 (steps), got {warmup}")
    if not style.strip():
        raise ValueError("--lr-decay-style must name the decay, e.g. cosine")
    return TrainingSchedule(warmup, style)
