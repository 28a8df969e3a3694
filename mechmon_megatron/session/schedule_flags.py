"""The three flags that name a run's learning-rate schedule in the offline tools.

``mechmon-calibrate`` (the healthy runs it fits the phase moments on) and ``mechmon-scan`` (the run
whose checkpoints it judges) both take ``--lr-warmup-iters N --lr-decay-style S --lr PEAK``, spelled
as Megatron spells them; the early-phase correction (``detect/phase_moments.py``) holds for one
schedule, so the three come together or not at all.
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

from mechmon_megatron.detect.phase_moments import TrainingSchedule

__all__ = ["SCHEDULE_FLAGS", "add_schedule_flags", "schedule_from_args"]


SCHEDULE_FLAGS = ("--lr-warmup-iters", "--lr-decay-style", "--lr")


def add_schedule_flags(parser: argparse.ArgumentParser, whose: str) -> None:
    """Add :data:`SCHEDULE_FLAGS`; ``whose``: "the runs'" or "the run's"."""
    parser.add_argument("--lr-warmup-iters", type=int, default=None,
                        help=f"{whose} learning-rate warm-up (steps); with --lr-decay-style and --lr, the "
                             "early-phase correction of young baselines")
    parser.add_argument("--lr-decay-style", default=None,
                        help=f"{whose} learning-rate decay (Megatron's --lr-decay-style: cosine, linear, WSD, ...)")
    parser.add_argument("--lr", type=float, default=None, help=f"{whose} peak learning rate (Megatron's --lr)")


def schedule_from_args(args: argparse.Namespace, error: type[Exception] = ValueError) -> Optional[TrainingSchedule]:
    """The schedule the three flags name, or None when none is given. ``error`` (the tool's own
    bad-input exception) naming the flags for some without the others, a negative warm-up, an
    empty style or a peak learning rate that is not a finite number > 0."""
    values = dict(zip(SCHEDULE_FLAGS, (args.lr_warmup_iters, args.lr_decay_style, args.lr)))
    given = [flag for flag, value in values.items() if value is not None]
    if not given:
        return None
    if len(given) < len(SCHEDULE_FLAGS):
        missing = [flag for flag in SCHEDULE_FLAGS if flag not in given]
        raise error(f"{' and '.join(given)} needs {' and '.join(missing)} too (the phase moments hold "
                    "for one schedule)")
    warmup, style, peak = values.values()
    if warmup < 0:
        raise error(f"--lr-warmup-iters must be >= 0 (steps), got {warmup}")
    if not style.strip():
        raise error("--lr-decay-style must name the decay, e.g. cosine")
    if not math.isfinite(peak) or peak <= 0:
        raise error(f"--lr must be a finite number > 0 (the peak learning rate), got {peak!r}")
    return TrainingSchedule(warmup, style, peak)
