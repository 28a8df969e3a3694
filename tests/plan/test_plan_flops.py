"""The planner's FLOP counts against a brute-force count of the kernels' matrix products."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from mechmon_megatron.monitors.update_spectrum import spectral_norm
from mechmon_megatron.plan.flops import full_cost, heads_cost, router_stats_cost
from mechmon_megatron.session.attention_check import check_full, check_heads
from mechmon_megatron.session.host import FullQK, QKWeights


def _pair(shape, gen):
    w = 0.02 * torch.randn(shape, generator=gen)
    return w, w + 1e-3 * torch.randn(shape, generator=gen)


def _matmul_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


class _MvCounter(TorchDispatchMode):
    """2 m n per matrix-vector product (FlopCounterMode does not count ``aten.mv``)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mv.default:
            m, n = args[0].shape
            self.flops += 2 * m * n
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["gram", "compressed"])
@pytest.mark.parametrize(("heads", "groups", "head_dim", "hidden"), [(4, 2, 4, 32), (3, 1, 8, 40), (2, 2, 2, 8)])
def test_heads_gemm_flops_match_the_kernel(method, heads, groups, head_dim, hidden):
    gen = torch.Generator().manual_seed(0)
    q0, q1 = _pair((heads, head_dim, hidden), gen)
    k0, k1 = _pair((groups, head_dim, hidden), gen)
    counted = _matmul_flops(lambda: check_heads(1, QKWeights(q0, k0), QKWeights(q1, k1), 2.0, method, False))
    assert heads_cost(heads, groups, head_dim, hidden, method, 4).gemm == counted


@pytest.mark.parametrize(("q_rows", "k_rows", "hidden", "rank"), [(16, 8, 32, 4), (24, 24, 20, 8), (12, 4, 64, 30)])
def test_full_gemm_and_power_iteration_flops_match_the_kernel(q_rows, k_rows, hidden, rank):
    gen = torch.Generator().manual_seed(1)
    q0, q1 = _pair((q_rows, hidden), gen)
    k0, k1 = _pair((k_rows, hidden), gen)
    counted = _matmul_flops(
        lambda: check_full(1, FullQK(q0, k0), FullQK(q1, k1), 2.0, "randomized", rank=rank, norm_iters=3))
    cost = full_cost(q_rows, k_rows, hidden, "randomized", rank, 3, 4)
    assert cost.gemm == counted
    with _MvCounter() as mv:
        spectral_norm(q1, power_iters=3)
    assert cost.gemv == mv.flops


def test_exact_full_matrix_has_no_gemm_and_more_factor_flops():
    rnd = full_cost(8192, 1024, 8192, "randomized", 128, 16, 4)
    exact = full_cost(8192, 1024, 8192, "exact", 128, 16, 4)
    assert exact.gemm == 0 and exact.factor > 10 * rnd.factor


def test_flops_scale_linearly_with_heads_and_tokens():
    one = heads_cost(1, 1, 128, 4096, "gram", 4)
    assert heads_cost(8, 8, 128, 4096, "gram", 4).flops == pytest.approx(8 * one.flops)
    assert router_stats_cost(2048, 256).flops == 2 * router_stats_cost(1024, 256).flops
