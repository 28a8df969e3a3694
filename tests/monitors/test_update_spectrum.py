"""Weight-increment spectra: per-head batched svdvals and full-matrix exact / randomized (with its
certified a-posteriori bound 0 <= sigma_true - sigma_est <= error_bound)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mechmon_megatron.monitors.update_spectrum import (
    per_head_update_singular_values,
    spectral_norm,
    tail_energy,
    update_singular_values,
)


def decaying_matrix(m, n, decay, seed, batch=()):
    """U diag(decay^i) V^T with random orthonormal U, V (float64): known singular values."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u = torch.linalg.qr(torch.randn(*batch, m, k, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(*batch, n, k, generator=gen, dtype=torch.float64)).Q
    s = decay ** torch.arange(k, dtype=torch.float64)
    return (u * s) @ v.mT, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_per_head_matches_dense_loop(dtype):
    gen = torch.Generator().manual_seed(0)
    w_prev = (0.02 * torch.randn(6, 8, 40, generator=gen)).to(dtype)
    w_now = (w_prev.double() + 1e-3 * torch.randn(6, 8, 40, generator=gen, dtype=torch.float64)).to(dtype)
    got = per_head_update_singular_values(w_prev, w_now)
    assert got.shape == (6, 8) and got.dtype == torch.float64
    for h in range(6):
        dw = w_now[h].double().T - w_prev[h].double().T  # paper layout; same spectrum
        torch.testing.assert_close(got[h], torch.linalg.svdvals(dw), rtol=1e-12, atol=0)


def test_per_head_wide_head_dim_and_zero_increment():
    w = torch.randn(3, 16, 10)
    got = per_head_update_singular_values(w, w.clone())
    assert got.shape == (3, 10)
    assert torch.equal(got, torch.zeros(3, 10, dtype=torch.float64))


def test_per_head_errors():
    w = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"w_prev must be 3-D"):
        per_head_update_singular_values(w[0], w[0])
    with pytest.raises(ValueError, match=r"w_prev and w_now must have the same shape"):
        per_head_update_singular_values(w, w[:1])
    bad = w.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"w_now contains 1 non-finite"):
        per_head_update_singular_values(w, bad)


@pytest.mark.parametrize("batch", [(), (3,)])
def test_exact_full_matrix(batch):
    dw, s = decaying_matrix(30, 20, 0.8, seed=1, batch=batch)
    w_prev = torch.randn(*batch, 30, 20, dtype=torch.float64)
    out = update_singular_values(w_prev, w_prev + dw)
    assert out["singular_values"].shape == (*batch, 20)
    torch.testing.assert_close(out["singular_values"], s.expand(*batch, 20), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out["fro_norm"], s.norm().expand(batch), rtol=1e-12, atol=0)
    assert torch.equal(out["error_bound"], torch.zeros(batch, dtype=torch.float64))
    top5 = update_singular_values(w_prev, w_prev + dw, rank=5)["singular_values"]
    assert top5.shape == (*batch, 5)


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(20, 80),
    n=st.integers(20, 80),
    decay=st.sampled_from([0.5, 0.8, 0.95, 1.0]),
    rank=st.integers(1, 12),
    oversample=st.integers(0, 8),
    power_iters=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_randomized_bound_is_certified(m, n, decay, rank, oversample, power_iters, seed):
    dw, _ = decaying_matrix(m, n, decay, seed)
    noise = torch.Generator().manual_seed(seed + 1)
    dw = dw + 1e-3 * torch.randn(m, n, generator=noise, dtype=torch.float64)  # slow tail
    zeros = torch.zeros(m, n, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    out = update_singular_values(
        zeros, dw, method="randomized", rank=rank, oversample=oversample, power_iters=power_iters, generator=gen
    )
    true = torch.linalg.svdvals(dw)[: min(rank, m, n)]
    est, bound = out["singular_values"], out["error_bound"].item()
    slack = 1e-12 * true[0].item()  # floating-point round-off of the certificate itself
    gap = true - est
    assert (gap >= -slack).all(), gap.min()
    assert (gap <= bound + slack).all(), (gap.max(), bound)
    assert out["fro_norm"].item() == pytest.approx(torch.linalg.matrix_norm(dw).item(), rel=1e-12)
    assert tail_energy(out["fro_norm"], est).item() >= bound**2 * (1 - 1e-9) - slack**2


def test_randomized_is_accurate_on_fast_decay_and_deterministic():
    dw, s = decaying_matrix(200, 150, 0.6, seed=4, batch=(2,))
    w_prev = torch.zeros_like(dw)
    out = update_singular_values(w_prev, dw, method="randomized", rank=8)
    torch.testing.assert_close(out["singular_values"], s[:8].expand(2, 8), rtol=1e-10, atol=0)
    assert (out["error_bound"] < 10 * s[8 + 10]).all()  # ~ tail beyond rank + oversample
    again = update_singular_values(w_prev, dw, method="randomized", rank=8)
    assert torch.equal(out["singular_values"], again["singular_values"])  # private fixed-seed generator


def test_randomized_does_not_touch_global_rng():
    state = torch.get_rng_state()
    update_singular_values(torch.zeros(10, 10), torch.eye(10), method="randomized", rank=2)
    assert torch.equal(state, torch.get_rng_state())


def test_randomized_zero_increment():
    w = torch.randn(12, 9)
    out = update_singular_values(w, w.clone(), method="randomized", rank=4)
    assert torch.equal(out["singular_values"], torch.zeros(4, dtype=torch.float64))
    assert out["error_bound"].item() == 0.0 and out["fro_norm"].item() == 0.0


def test_tail_energy_is_clamped():
    fro = torch.tensor([5.0, 1.0])
    s = torch.tensor([[3.0, 4.0], [1.0, 1e-9]])
    torch.testing.assert_close(tail_energy(fro, s), torch.tensor([0.0, 0.0], dtype=torch.float64))
    assert tail_energy(torch.tensor(5.0), torch.tensor([3.0])).item() == 16.0


def test_full_matrix_errors():
    w = torch.randn(6, 5)
    with pytest.raises(ValueError, match=r"method must be 'exact' or 'randomized'"):
        update_singular_values(w, w, method="lanczos")
    with pytest.raises(ValueError, match=r"rank is required for method='randomized'"):
        update_singular_values(w, w, method="randomized")
    with pytest.raises(ValueError, match=r"rank must be a positive int or None"):
        update_singular_values(w, w, rank=0)
    with pytest.raises(ValueError, match=r"oversample must be an int >= 0"):
        update_singular_values(w, w, method="randomized", rank=2, oversample=-1)
    with pytest.raises(ValueError, match=r"power_iters must be an int >= 0"):
        update_singular_values(w, w, method="randomized", rank=2, power_iters=1.5)
    with pytest.raises(ValueError, match=r"w_prev must have at least 2 dimension"):
        update_singular_values(w[0], w[0])
    with pytest.raises(ValueError, match=r"w_prev and w_now must have the same shape"):
        update_singular_values(w, w.T)
    bad = w.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"w_prev contains 1 non-finite"):
        update_singular_values(bad, w)


@pytest.mark.parametrize("m,n", [(48, 32), (32, 96)])
def test_spectral_norm_power_iteration_is_a_converging_lower_bound(m, n):
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=g, dtype=torch.float64))
    s = torch.linspace(1.0, 0.05, min(m, n), dtype=torch.float64)
    s[0] = 2.0  # a gap, as trained attention weights have: (s2/s1)^2 = 0.25 per iteration
    w = (u * s) @ v.T
    exact = torch.linalg.matrix_norm(w, ord=2)
    assert float(spectral_norm(w, power_iters=0)) == pytest.approx(float(exact), rel=1e-12)
    previous = 0.0
    for iters in (1, 2, 4, 16):
        estimate = float(spectral_norm(w.float(), power_iters=iters))
        assert estimate <= float(exact) * (1 + 1e-6)  # never above the true norm (fp32 input: 1e-6)
        assert estimate >= previous - 1e-9
        previous = estimate
    assert previous == pytest.approx(float(exact), rel=1e-6)


def test_spectral_norm_errors():
    with pytest.raises(ValueError, match="power_iters"):
        spectral_norm(torch.ones(3, 3), power_iters=-1)
    with pytest.raises(ValueError, match="weight"):
        spectral_norm(torch.ones(3))
