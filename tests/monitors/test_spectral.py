"""spectral_stats: closed-form spectra, alpha handling, degenerate input, batch shapes, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mechmon_megatron.monitors.spectral import SPECTRAL_STAT_KEYS, spectral_stats

FLOAT_KEYS = ("entropy", "normalized_entropy", "effective_rank", "stable_rank", "fro_norm")


def test_keys_and_dtypes():
    out = spectral_stats(torch.tensor([3.0, 1.0]))
    assert tuple(out) == SPECTRAL_STAT_KEYS
    for key in FLOAT_KEYS:
        assert out[key].dtype == torch.float64
    assert out["valid"].dtype == torch.bool
    assert out["num_nonzero"].dtype == torch.int64


@pytest.mark.parametrize("alpha", [1.0, 2.0, 0.5, 3.7])
def test_one_hot_spectrum_has_zero_entropy(alpha):
    out = spectral_stats(torch.tensor([5.0, 0.0, 0.0, 0.0]), alpha=alpha)
    assert out["entropy"].item() == 0.0
    assert out["effective_rank"].item() == 1.0
    assert out["normalized_entropy"].item() == 0.0  # r_eff = 1 -> defined as 0
    assert out["stable_rank"].item() == 1.0
    assert out["fro_norm"].item() == 5.0
    assert out["num_nonzero"].item() == 1
    assert out["valid"].item()


@pytest.mark.parametrize("alpha", [1.0, 2.0])
@pytest.mark.parametrize("r", [1, 2, 7, 64])
def test_flat_spectrum(alpha, r):
    out = spectral_stats(torch.full((r,), 0.3, dtype=torch.float64), alpha=alpha)
    assert out["entropy"].item() == pytest.approx(math.log(r), abs=1e-12)
    assert out["effective_rank"].item() == pytest.approx(r, rel=1e-12)
    assert out["stable_rank"].item() == pytest.approx(r, rel=1e-12)
    assert out["fro_norm"].item() == pytest.approx(0.3 * math.sqrt(r), rel=1e-12)
    assert out["normalized_entropy"].item() == pytest.approx(1.0 if r > 1 else 0.0, abs=1e-12)
    assert out["num_nonzero"].item() == r


def test_alpha_one_and_two_by_hand():
    s = torch.tensor([3.0, 1.0])
    # alpha = 1: p = (3/4, 1/4); alpha = 2: p = (9/10, 1/10).
    h1 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    h2 = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))
    out1, out2 = spectral_stats(s, alpha=1), spectral_stats(s, alpha=2.0)
    assert out1["entropy"].item() == pytest.approx(h1, abs=1e-15)
    assert out2["entropy"].item() == pytest.approx(h2, abs=1e-15)
    assert out1["effective_rank"].item() == pytest.approx(math.exp(h1), abs=1e-15)
    assert out2["normalized_entropy"].item() == pytest.approx(h2 / math.log(2), abs=1e-15)
    # alpha-independent quantities
    for out in (out1, out2):
        assert out["stable_rank"].item() == pytest.approx(10 / 9, abs=1e-15)
        assert out["fro_norm"].item() == pytest.approx(math.sqrt(10), abs=1e-15)


def test_order_and_scale_invariance():
    s = torch.tensor([0.2, 4.0, 1.0, 0.7], dtype=torch.float64)
    base = spectral_stats(s)
    shuffled = spectral_stats(s.flip(0) * 1e-30)
    for key in ("entropy", "normalized_entropy", "effective_rank", "stable_rank"):
        assert shuffled[key].item() == pytest.approx(base[key].item(), rel=1e-12)
    assert shuffled["fro_norm"].item() == pytest.approx(base["fro_norm"].item() * 1e-30, rel=1e-12)


def test_huge_and_tiny_values_do_not_overflow():
    out = spectral_stats(torch.tensor([1e200, 1e200], dtype=torch.float64))
    assert out["entropy"].item() == pytest.approx(math.log(2))
    assert out["fro_norm"].item() == pytest.approx(math.sqrt(2) * 1e200)
    out = spectral_stats(torch.tensor([1e-300, 1e-300], dtype=torch.float64))
    assert out["entropy"].item() == pytest.approx(math.log(2))


def test_values_below_tolerance_count_as_zero():
    # tol = r * eps(float64) * max = 3 * 2.2e-16 * 1: 1e-17 is round-off, 1e-10 is not.
    out = spectral_stats(torch.tensor([1.0, 1e-10, 1e-17], dtype=torch.float64))
    assert out["num_nonzero"].item() == 2
    # the tolerance uses the input dtype's eps: 1e-10 is round-off for float32 values
    out32 = spectral_stats(torch.tensor([1.0, 1e-10, 1e-17], dtype=torch.float32))
    assert out32["num_nonzero"].item() == 1
    assert out32["entropy"].item() == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        [0.0, 0.0, 0.0],
        [1.0, float("nan"), 0.5],
        [float("inf"), 1.0, 0.0],
        [float("nan")] * 3,
        [-float("inf"), 1.0, 1.0],
    ],
)
def test_zero_and_non_finite_spectra_are_flagged_and_all_zero(bad):
    out = spectral_stats(torch.tensor(bad))
    assert not out["valid"].item()
    assert out["num_nonzero"].item() == 0
    for key in FLOAT_KEYS:
        assert out[key].item() == 0.0, key


def test_batch_shape_preserved_and_rows_independent():
    s = torch.rand(2, 3, 5, dtype=torch.float64) + 0.1
    s[0, 1] = float("nan")
    s[1, 2] = 0.0
    out = spectral_stats(s, alpha=1.0)
    for key in SPECTRAL_STAT_KEYS:
        assert out[key].shape == (2, 3), key
    assert out["valid"].tolist() == [[True, False, True], [True, True, False]]
    for i, j in [(0, 0), (0, 2), (1, 0), (1, 1)]:
        single = spectral_stats(s[i, j], alpha=1.0)
        for key in FLOAT_KEYS:
            assert out[key][i, j].item() == pytest.approx(single[key].item(), rel=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_low_precision_inputs_are_upcast(dtype):
    out = spectral_stats(torch.tensor([2.0, 2.0, 2.0, 2.0], dtype=dtype))
    assert out["entropy"].dtype == torch.float64
    assert out["entropy"].item() == pytest.approx(math.log(4), abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=40),
    alpha=st.floats(0.1, 4.0),
)
def test_bounds_hold_for_any_spectrum(values, alpha):
    out = spectral_stats(torch.tensor(values, dtype=torch.float64), alpha=alpha)
    for key in FLOAT_KEYS:
        assert torch.isfinite(out[key]).all()
    if not out["valid"]:
        return
    r_eff = out["num_nonzero"].item()
    assert 1 <= r_eff <= len(values)
    assert 0.0 <= out["entropy"].item() <= math.log(r_eff) + 1e-12
    assert 0.0 <= out["normalized_entropy"].item() <= 1.0
    assert 1.0 - 1e-12 <= out["effective_rank"].item() <= r_eff + 1e-9
    assert 1.0 <= out["stable_rank"].item() <= len(values) + 1e-9


def test_errors():
    with pytest.raises(ValueError, match=r"singular_values must have at least 1 dimension"):
        spectral_stats(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"singular_values has an empty last dimension"):
        spectral_stats(torch.zeros(3, 0))
    with pytest.raises(ValueError, match=r"singular_values must be non-negative"):
        spectral_stats(torch.tensor([1.0, -0.5]))
    with pytest.raises(ValueError, match=r"singular_values must have a real floating-point dtype"):
        spectral_stats(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"singular_values must be a torch.Tensor"):
        spectral_stats([1.0, 2.0])
    for alpha in (0.0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match=r"alpha must be a finite number > 0"):
            spectral_stats(torch.tensor([1.0]), alpha=alpha)
