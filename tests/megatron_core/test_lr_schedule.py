"""``schedule_of_args``: a Megatron job's learning-rate schedule as the early-phase correction compares it.

Megatron's argument names on a ``types.SimpleNamespace`` (no torch or megatron needed by the
function itself): an iteration-based warm-up, ``--lr-warmup-fraction`` of ``--lr-decay-iters`` (or
of ``--train-iters`` when the decay iterations are not set), a sample-based schedule
(``--train-samples``) and a job without ``--lr-decay-style`` (None: the correction is off); the
peak learning rate ``--lr`` (None where it is not set).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from mechmon_megatron.adapters.megatron_core.lr_schedule import schedule_of_args
from mechmon_megatron.detect.phase_moments import TrainingSchedule


def _args(**change):
    """Megatron's defaults for the fields read (``--lr-warmup-iters 0``, no fraction, linear decay)."""
    args = dict(lr_decay_style="linear", lr_warmup_iters=0, lr_warmup_fraction=None, lr_decay_iters=None,
                train_iters=10_000, train_samples=None)
    args.update(change)
    return SimpleNamespace(**args)


@pytest.mark.parametrize("warmup,style", [(100, "cosine"), (0, "linear"), (2000, "WSD"), (1, "inverse-square-root")])
def test_iteration_based_warm_up(warmup, style):
    assert schedule_of_args(_args(lr_warmup_iters=warmup, lr_decay_style=style)) == TrainingSchedule(warmup, style)


@pytest.mark.parametrize("lr,peak", [(2e-3, 2e-3), (3, 3.0), (None, None), (0.0, None), (-1e-3, None)])
def test_the_peak_learning_rate_is_megatrons_lr(lr, peak):
    got = schedule_of_args(_args(lr=lr, lr_warmup_iters=100, lr_decay_style="cosine"))
    assert got == TrainingSchedule(100, "cosine", peak) and (peak is None or isinstance(got.peak_lr, float))
    fraction = schedule_of_args(_args(lr=lr, lr_warmup_fraction=0.01, lr_decay_iters=5000))
    assert fraction == TrainingSchedule(50, "linear", peak)


def test_a_warm_up_fraction_counts_of_the_decay_iterations():
    got = schedule_of_args(_args(lr_warmup_fraction=0.01, lr_decay_iters=5000, lr_warmup_iters=7,
                                 lr_decay_style="cosine"))
    assert got == TrainingSchedule(50, "cosine")  # the fraction wins over --lr-warmup-iters


def test_a_warm_up_fraction_without_decay_iterations_counts_of_the_training_iterations():
    got = schedule_of_args(_args(lr_warmup_fraction=0.02, lr_decay_iters=None, train_iters=10_000))
    assert got == TrainingSchedule(200, "linear")


def test_a_warm_up_fraction_with_no_iteration_count_is_unknown():
    assert schedule_of_args(_args(lr_warmup_fraction=0.02, lr_decay_iters=None, train_iters=None)) is None


@pytest.mark.parametrize("change", [
    {"train_samples": 1_000_000, "train_iters": None},
    {"train_samples": 1_000_000, "lr_warmup_fraction": 0.01, "train_iters": None},
    {"train_samples": 1_000_000, "lr_warmup_iters": 100},
])
def test_a_sample_based_schedule_is_unknown(change):
    assert schedule_of_args(_args(**change)) is None


@pytest.mark.parametrize("style", [None, ""])
def test_no_decay_style_is_unknown(style):
    assert schedule_of_args(_args(lr_decay_style=style, lr_warmup_iters=100)) is None


def test_missing_fields_are_read_as_megatron_defaults_or_unknown():
    assert schedule_of_args(SimpleNamespace()) is None  # no --lr-decay-style at all
    assert schedule_of_args(SimpleNamespace(lr_decay_style="cosine")) == TrainingSchedule(0, "cosine")
    assert schedule_of_args(SimpleNamespace(lr_decay_style="cosine", lr_warmup_iters=None)) == TrainingSchedule(
        0, "cosine")


def test_the_result_is_a_plain_int_and_str():
    got = schedule_of_args(_args(lr_warmup_fraction=0.5, lr_decay_iters=301))
    assert got == TrainingSchedule(150, "linear")
    assert type(got.lr_warmup_steps) is int and type(got.lr_decay_style) is str


def test_a_warm_up_fraction_is_rounded_not_truncated():
    assert schedule_of_args(_args(lr_warmup_fraction=0.29, lr_decay_iters=100)) == TrainingSchedule(29, "linear")


def test_importing_the_module_does_not_import_megatron():
    """The module reads plain attributes; its package imports torch (the callback), not megatron."""
    code = ("import sys; import mechmon_megatron.adapters.megatron_core.lr_schedule; "
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
