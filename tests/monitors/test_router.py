"""Router monitors against brute-force references (explicit fp64 softmax, loops over pairs)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mechmon_megatron.monitors.router import (
    RouterEntropySummary,
    expert_load,
    load_fractions,
    max_violation,
    router_conditioning_ratio,
    router_weight_similarity,
    routing_entropy,
    summarize_routing,
)


def _entropy_reference(logits: torch.Tensor) -> torch.Tensor:
    x = logits.to(torch.float64)
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    p = e / e.sum(dim=-1, keepdim=True)
    terms = torch.where(p > 0, p * torch.log(p), torch.zeros_like(p))
    return -terms.sum(dim=-1)


def _pairwise_cosine_mean(w: torch.Tensor) -> float:
    rows = [r for r in w.to(torch.float64) if r.norm() > 0]
    sims = [float(a @ b / (a.norm() * b.norm())) for a, b in itertools.permutations(rows, 2)]
    return sum(sims) / len(sims)


# -- routing entropy ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 8), (2, 5, 16), (64,)])
@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
def test_entropy_matches_fp64_softmax(shape, scale):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(shape, generator=g) * scale
    got = routing_entropy(logits)
    assert got.shape == shape[:-1]
    torch.testing.assert_close(got.double(), _entropy_reference(logits), atol=2e-6, rtol=1e-5)


def test_entropy_huge_logits_exact():
    e = 8
    one_big = torch.zeros(e)
    one_big[3] = 1e4
    equal_big = torch.full((e,), 1e4)
    two_big = torch.tensor([1e4, 1e4] + [-1e4] * (e - 2))
    h = routing_entropy(torch.stack([one_big, equal_big, -equal_big, two_big]))
    assert h[0].item() == 0.0 and not math.copysign(1.0, h[0].item()) < 0
    assert h[1].item() == pytest.approx(math.log(e), abs=1e-6)
    assert h[2].item() == pytest.approx(math.log(e), abs=1e-6)
    assert h[3].item() == pytest.approx(math.log(2), abs=1e-6)
    h64 = routing_entropy(torch.stack([one_big, equal_big]).double())
    assert h64.dtype == torch.float64
    assert h64[1].item() == pytest.approx(math.log(e), abs=1e-12)


def test_entropy_bf16_input_upcast():
    logits = (torch.randn(32, 16, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    got = routing_entropy(logits)
    assert got.dtype == torch.float32
    # Reference on the bf16-rounded values: the only error left is the fp32 log-softmax.
    torch.testing.assert_close(got.double(), _entropy_reference(logits.float()), atol=2e-6, rtol=1e-5)


def test_entropy_nonfinite_flagged_and_masked_experts():
    logits = torch.tensor(
        [[0.0, 1.0, 2.0], [math.nan, 0.0, 0.0], [math.inf, 0.0, 0.0], [-math.inf, 0.0, 0.0]]
    )
    h = routing_entropy(logits)
    assert math.isfinite(h[0].item())
    assert math.isnan(h[1].item()) and math.isnan(h[2].item())
    assert h[3].item() == pytest.approx(math.log(2), abs=1e-6)  # masked expert has p = 0


def test_entropy_rejects_integer_logits():
    with pytest.raises(ValueError, match="floating-point"):
        routing_entropy(torch.ones(3, 4, dtype=torch.int64))


def _normalised_score_entropy_reference(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """fp64 from the definition: p_e = s(z_e) / sum_j s(z_j), H = -sum_e p_e log p_e."""
    z = logits.to(torch.float64)
    s = torch.sigmoid(z) if score_function == "sigmoid" else torch.nn.functional.softplus(z).sqrt()
    p = s / s.sum(dim=-1, keepdim=True)
    return -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(dim=-1)


@pytest.mark.parametrize("score_function", ["sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("scale", [0.1, 3.0, 15.0])
def test_entropy_of_normalised_scores_matches_fp64(score_function, scale):
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(2)) * scale
    got = routing_entropy(logits, score_function)
    assert got.shape == (64,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _normalised_score_entropy_reference(logits, score_function),
                               atol=2e-6, rtol=1e-5)
    assert bool((got >= 0).all()) and bool((got <= math.log(16) + 1e-6).all())


def test_sigmoid_entropy_extremes_and_nonfinite():
    e = 8
    # sigma saturates at 1: k confident experts and the rest at -inf-like logits give log k ...
    two_sure = torch.tensor([50.0, 50.0] + [-1e4] * (e - 2))
    # ... equal logits of any magnitude give log E, and a huge positive logit is not a winner
    # over the other saturated scores (sigmoid scores do not compete as softmax does).
    equal = torch.full((e,), -30.0)
    one_huge = torch.tensor([1e4] + [40.0] * (e - 1))
    masked = torch.tensor([-math.inf, 0.0, 0.0, 0.0])
    h = routing_entropy(torch.stack([two_sure, equal, one_huge]), "sigmoid")
    assert h[0].item() == pytest.approx(math.log(2), abs=1e-6)
    assert h[1].item() == pytest.approx(math.log(e), abs=1e-5)
    assert h[2].item() == pytest.approx(math.log(e), abs=1e-6)
    assert routing_entropy(masked, "sigmoid").item() == pytest.approx(math.log(3), abs=1e-6)
    bad = routing_entropy(torch.tensor([[math.inf, 0.0, 0.0], [math.nan, 0.0, 0.0]]), "sigmoid")
    assert bool(torch.isnan(bad).all())  # +inf is flagged as for softmax, though sigma(+inf) = 1
    with pytest.raises(ValueError, match="'tanh'.*supported"):
        routing_entropy(torch.zeros(2, 4), "tanh")


def test_softmax_default_is_unchanged_and_summary_takes_the_score_function():
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(3)) * 2
    assert torch.equal(routing_entropy(logits), routing_entropy(logits, "softmax"))
    a = summarize_routing(logits, 2, num_bins=32).to_flat_tensor()
    assert torch.equal(a, summarize_routing(logits, 2, num_bins=32, score_function="softmax").to_flat_tensor())
    sig = summarize_routing(logits, 2, num_bins=32, score_function="sigmoid")
    expected = _normalised_score_entropy_reference(logits, "sigmoid")
    torch.testing.assert_close(sig.entropy_sum, expected.sum(), rtol=1e-6, atol=1e-6)
    assert torch.equal(sig.expert_counts, summarize_routing(logits, 2, num_bins=32).expert_counts)


def test_summary_accepts_megatron_flattened_routing_map_and_reports_assignments():
    logits = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(4))  # [s, b, E]
    routing_map = torch.zeros(15, 8, dtype=torch.bool)  # megatron-core's [s * b, E]
    routing_map[:, 1] = True
    routing_map[:10, 2] = True  # 5 tokens lost their second expert (capacity)
    s = summarize_routing(logits, 2, routing_map=routing_map)
    assert s.expert_counts.tolist() == [0, 15, 10, 0, 0, 0, 0, 0]
    assert s.finalize()["assignments_per_token"] == pytest.approx(25 / 15)
    with pytest.raises(ValueError, match="one row of 8 experts per token"):
        summarize_routing(logits, 2, routing_map=routing_map[:, :4])


# -- router weight similarity / conditioning ---------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_experts", [2, 5, 12])
def test_similarity_equals_mean_pairwise_cosine(seed, num_experts):
    g = torch.Generator().manual_seed(seed)
    # A shared component makes the cosines non-trivial (positive on average).
    w = torch.randn(num_experts, 24, generator=g) + 0.7 * torch.randn(1, 24, generator=g)
    assert router_weight_similarity(w).item() == pytest.approx(_pairwise_cosine_mean(w), abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 10), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_similarity_identity_hypothesis(num_experts, hidden, seed):
    w = torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    s = router_weight_similarity(w).item()
    assert s == pytest.approx(_pairwise_cosine_mean(w), abs=1e-10)
    assert -1.0 / (num_experts - 1) - 1e-12 <= s <= 1.0 + 1e-12


def test_similarity_degenerate_cases():
    v = torch.randn(1, 10)
    assert router_weight_similarity(v.repeat(6, 1) * torch.arange(1, 7.0)[:, None]).item() == pytest.approx(1.0)
    assert router_weight_similarity(torch.eye(5)).item() == pytest.approx(0.0, abs=1e-15)
    assert router_weight_similarity(torch.cat([v, -v])).item() == pytest.approx(-1.0)
    # Zero rows are excluded: the mean is over pairs of non-zero rows.
    w = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    w[2] = 0
    assert router_weight_similarity(w).item() == pytest.approx(_pairwise_cosine_mean(w), abs=1e-12)
    w[1:] = 0
    assert math.isnan(router_weight_similarity(w).item())  # fewer than 2 non-zero rows: flagged
    assert router_weight_similarity(torch.randn(4, 8).to(torch.bfloat16)).dtype == torch.float64
    with pytest.raises(ValueError, match="at least 2 experts"):
        router_weight_similarity(torch.randn(1, 8))
    with pytest.raises(ValueError, match=r"\[num_experts, hidden\]"):
        router_weight_similarity(torch.randn(8))


def test_conditioning_ratio_by_hand():
    w = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 3.0]])
    # w_bar = (2, 1); distances sqrt(2), sqrt(2), 2; ||w_bar|| = sqrt(5).
    expected = 2.0 / math.sqrt(5.0)
    assert router_conditioning_ratio(w).item() == pytest.approx(expected, rel=1e-14)
    assert router_conditioning_ratio(torch.ones(4, 3)).item() == 0.0
    assert router_conditioning_ratio(torch.tensor([[1.0, 2.0], [-1.0, -2.0]])).item() == math.inf
    assert router_conditioning_ratio(torch.zeros(3, 2)).item() == math.inf
    with pytest.raises(ValueError, match="at least 2 experts"):
        router_conditioning_ratio(torch.randn(1, 4))


@pytest.mark.parametrize("seed", range(5))
def test_small_conditioning_ratio_bounds_pairwise_cosine(seed):
    # docs/METHOD.md section 6: for eps < 1 every pair has cos >= 1 - 2 eps^2.
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(1, 16, generator=g) + 0.2 * torch.randn(6, 16, generator=g)
    eps = router_conditioning_ratio(w).item()
    assert eps < 1
    u = torch.nn.functional.normalize(w.double(), dim=1)
    assert (u @ u.T).min().item() >= 1 - 2 * eps**2 - 1e-12


# -- load statistics ---------------------------------------------------------------------------


def test_expert_load_matches_loop():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, 6, generator=g)
    counts = expert_load(logits, topk=2)
    expected = [0] * 6
    for row in logits.reshape(-1, 6):
        for e in torch.topk(row, 2).indices.tolist():
            expected[e] += 1
    assert counts.tolist() == expected and counts.dtype == torch.int64
    routing_map = torch.zeros(120, 6, dtype=torch.bool)
    routing_map.scatter_(1, torch.topk(logits.reshape(-1, 6), 2).indices, True)
    assert expert_load(routing_map).tolist() == expected
    with pytest.raises(ValueError, match="needs topk"):
        expert_load(logits)
    with pytest.raises(ValueError, match="topk must be in"):
        expert_load(logits, topk=7)


def test_fractions_and_maxvio():
    counts = torch.tensor([10, 30, 20, 20])
    torch.testing.assert_close(load_fractions(counts), torch.tensor([0.125, 0.375, 0.25, 0.25], dtype=torch.float64))
    assert max_violation(counts).item() == pytest.approx(30 / 20 - 1)
    assert max_violation(torch.full((8,), 5)).item() == 0.0
    assert math.isnan(max_violation(torch.zeros(4)).item())


# -- reducible summary -------------------------------------------------------------------------


def _logits(seed: int, tokens: int = 3000, experts: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Per-token temperature spreads the entropies over most of [0, log E].
    return torch.randn(tokens, experts, generator=g) * torch.rand(tokens, 1, generator=g) * 6


@pytest.mark.parametrize("seed", range(3))
def test_merge_of_halves_equals_whole(seed):
    logits = _logits(seed)
    whole = summarize_routing(logits, topk=2, num_bins=256)
    half = summarize_routing(logits[:1234], 2, 256).merge(summarize_routing(logits[1234:], 2, 256))
    torch.testing.assert_close(half.to_flat_tensor(), whole.to_flat_tensor(), rtol=1e-12, atol=1e-9)
    a, b = half.finalize(), whole.finalize()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-12), k


def test_flat_round_trip_simulates_all_reduce():
    parts = [summarize_routing(_logits(s, 500), topk=4) for s in range(3)]
    reduced = torch.stack([p.to_flat_tensor() for p in parts]).sum(0)  # what all_reduce(SUM) does
    assert reduced.numel() == RouterEntropySummary.flat_size(16, 512) and reduced.dtype == torch.float64
    back = RouterEntropySummary.from_flat_tensor(reduced, num_experts=16, num_bins=512)
    direct = summarize_routing(torch.cat([_logits(s, 500) for s in range(3)]), topk=4)
    torch.testing.assert_close(back.to_flat_tensor(), direct.to_flat_tensor(), rtol=1e-12, atol=1e-9)
    with pytest.raises(ValueError, match="vector of length"):
        RouterEntropySummary.from_flat_tensor(reduced, num_experts=8, num_bins=512)
    with pytest.raises(ValueError, match="different shapes"):
        parts[0].merge(summarize_routing(_logits(0, 10), topk=4, num_bins=64))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_bins", [32, 512])
def test_finalize_against_direct_computation(seed, num_bins):
    logits = _logits(seed, tokens=2000 + 37 * seed)
    out = summarize_routing(logits, topk=2, num_bins=num_bins).finalize()
    h = _entropy_reference(logits)
    log_e = math.log(16)
    width = log_e / num_bins
    assert out["num_tokens"] == logits.shape[0] and out["num_nonfinite_tokens"] == 0
    assert out["token_entropy_mean"] == pytest.approx(h.mean().item(), rel=1e-6)
    assert out["token_entropy_normalized"] == pytest.approx(h.mean().item() / log_e, rel=1e-6)
    for q, key in [(0.01, "token_entropy_p01"), (0.05, "token_entropy_p05"), (0.10, "token_entropy_p10")]:
        exact = torch.quantile(h, q, interpolation="lower").item()
        assert abs(out[key] - exact) <= width + 1e-9, key
    counts = expert_load(logits, 2).double()
    assert out["max_vio"] == pytest.approx(max_violation(counts).item())
    assert out["load_fraction_min"] == pytest.approx(load_fractions(counts).min().item())
    assert out["load_fraction_max"] == pytest.approx(load_fractions(counts).max().item())


def test_summary_excludes_nonfinite_tokens_and_uses_routing_map():
    logits = _logits(9, tokens=50, experts=4)
    logits[7, 1] = math.nan
    routing_map = torch.zeros(50, 4, dtype=torch.bool)
    routing_map[:, 0] = True
    s = summarize_routing(logits, topk=1, routing_map=routing_map)
    out = s.finalize()
    assert out["num_tokens"] == 49 and out["num_nonfinite_tokens"] == 1
    assert s.expert_counts.tolist() == [49.0, 0.0, 0.0, 0.0]
    assert out["max_vio"] == pytest.approx(3.0)
    assert math.isfinite(out["token_entropy_mean"])
    assert s.histogram.sum().item() == 49
    with pytest.raises(ValueError, match="routing_map must be"):
        summarize_routing(logits, topk=1, routing_map=routing_map[:10])
    with pytest.raises(ValueError, match="num_experts >= 2"):
        summarize_routing(torch.randn(5, 1), topk=1)


def test_empty_summary_is_flagged_not_raised():
    out = summarize_routing(torch.empty(0, 8), topk=2).finalize()
    assert out["num_tokens"] == 0
    assert all(math.isnan(out[k]) for k in ("token_entropy_mean", "token_entropy_p05", "max_vio"))


def test_collapsed_routing_has_low_entropy_and_high_maxvio():
    healthy = summarize_routing(torch.randn(1000, 8, generator=torch.Generator().manual_seed(0)), topk=2).finalize()
    collapsed_logits = torch.randn(1000, 8, generator=torch.Generator().manual_seed(0))
    collapsed_logits[:, 0] += 20.0
    collapsed = summarize_routing(collapsed_logits, topk=2).finalize()
    assert collapsed["token_entropy_mean"] < 0.1 * healthy["token_entropy_mean"]
    assert collapsed["max_vio"] > healthy["max_vio"]
    assert collapsed["load_fraction_max"] >= 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path_has_no_host_sync():
    # The monitors run inside the training step: they must not stall the stream.
    logits = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(64, 512, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        summary = summarize_routing(logits, topk=8)
        summary = summary.merge(summarize_routing(logits, topk=8))
        router_weight_similarity(weight)
        router_conditioning_ratio(weight)
        max_violation(expert_load(logits, topk=8))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert summary.finalize()["num_tokens"] == 2 * 4096
