"""Leading Delta2 directions from the factors == those of the dense d x d matrix (float64 svd)."""

from __future__ import annotations

import pytest
import torch

from mechmon_megatron.monitors.leading_direction import delta2_spectrum_and_directions, direction_persistence
from mechmon_megatron.monitors.qk_increment import qk_increment_singular_values


def _dense_leading(wq_prev, wk_prev, wq_now, wk_now, head):
    groups = wk_prev.shape[0]
    g = head // (wq_prev.shape[0] // groups)
    q0, k0 = wq_prev[head].double().T, wk_prev[g].double().T
    dq, dk = wq_now[head].double().T - q0, wk_now[g].double().T - k0
    u, _, vh = torch.linalg.svd(dq @ k0.T + q0 @ dk.T)
    return u[:, 0], vh[0]


@pytest.mark.parametrize("method", ["gram", "compressed"])
@pytest.mark.parametrize("heads, groups, head_dim, hidden", [(4, 4, 8, 32), (4, 2, 8, 32), (2, 1, 16, 24)])
def test_directions_match_the_dense_svd(heads, groups, head_dim, hidden, method):
    g = torch.Generator().manual_seed(heads * 100 + groups + hidden)
    wq = torch.randn(heads, head_dim, hidden, generator=g)
    wk = torch.randn(groups, head_dim, hidden, generator=g)
    wq2 = wq + 0.01 * torch.randn(wq.shape, generator=g)
    wk2 = wk + 0.01 * torch.randn(wk.shape, generator=g)
    s, u, v = delta2_spectrum_and_directions(wq, wk, wq2, wk2, method=method)
    assert u.shape == v.shape == (heads, hidden) and u.dtype == torch.float64
    dense = qk_increment_singular_values(wq, wk, wq2, wk2, method="dense")["delta2"]
    assert s.shape == dense.shape
    assert torch.allclose(s, dense, rtol=1e-7, atol=1e-9 * float(dense.max()))
    for head in range(heads):
        du, dv = _dense_leading(wq, wk, wq2, wk2, head)
        assert float((u[head] @ du).abs()) == pytest.approx(1.0, abs=1e-9)
        assert float((v[head] @ dv).abs()) == pytest.approx(1.0, abs=1e-9)
        # The singular pair keeps its relative sign: u^T Delta2 v = +s1 > 0.
        assert float((u[head] @ du) * (v[head] @ dv)) > 0


def test_persistence_is_one_for_a_repeated_direction_and_small_for_random_ones():
    g = torch.Generator().manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(3, 512, generator=g, dtype=torch.float64), dim=-1)
    v = torch.nn.functional.normalize(torch.randn(3, 512, generator=g, dtype=torch.float64), dim=-1)
    assert torch.allclose(direction_persistence(u, v, -u, v), torch.ones(3, dtype=torch.float64))
    other = torch.nn.functional.normalize(torch.randn(3, 512, generator=g, dtype=torch.float64), dim=-1)
    assert float(direction_persistence(u, v, other, v).max()) < 0.2
    with pytest.raises(ValueError, match="shapes differ"):
        direction_persistence(u, v, u[:2], v)
