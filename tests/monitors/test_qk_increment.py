"""QK-increment spectra: every method against an independent dense reference built here from the
docs/METHOD.md section 3 formulas (explicit d x d Delta matrices, torch.linalg.svdvals in float64).

Tolerances (``assert_spectra_close``), per row of singular values with largest reference value
``top``:

* ``dense`` and ``compressed``: relative error <= 1e-6 for reference values >= 1e-6 * top, and
  every value (incl. the zero-padded / rank-deficient tail) within 1e-9 * top (no spurious values).
* ``gram`` squares the condition number of the factors, so near rank deficiency (e.g. a low-rank
  dW plus fp32 round-off) costs it ~sqrt(eps) ~ 1.5e-8 absolute: relative error <= 1e-6 only for
  values >= 1e-4 * top, and every value within 1e-7 * top. (Measured over 300 random configs:
  gram 3e-8 * top absolute, 5e-9 relative above 1e-4 * top; compressed 5e-13 and 5e-8 above
  1e-6 * top.) For entropy this floor is irrelevant: p_i of a value at 1e-4 * top is ~1e-8.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechmon_megatron.monitors.qk_increment import QK_DELTA_KEYS, qk_increment_singular_values

FAST_METHODS = ("gram", "compressed")
ALL_METHODS = ("dense",) + FAST_METHODS
REL_TOL = 1e-6
# method -> (relative-error floor as a fraction of the row's largest value, absolute tolerance)
TOLERANCES = {"dense": (1e-6, 1e-9), "compressed": (1e-6, 1e-9), "gram": (1e-4, 1e-7)}


def reference_deltas(wq_prev, wk_prev, wq_now, wk_now):
    """Dense Delta1/2/3 per head, paper layout (W_q = wq[h].T, d x h_d), float64."""
    heads, groups = wq_prev.shape[0], wk_prev.shape[0]
    per_group = heads // groups
    out = []
    for h in range(heads):
        g = h // per_group
        wq0, wq1 = wq_prev[h].double().T, wq_now[h].double().T
        wk0, wk1 = wk_prev[g].double().T, wk_now[g].double().T
        dwq, dwk = wq1 - wq0, wk1 - wk0
        delta1 = wq1 @ wk1.T - wq0 @ wk0.T
        delta2 = dwq @ wk0.T + wq0 @ dwk.T
        delta3 = dwq @ dwk.T
        out.append((delta1, delta2, delta3))
    return out


def reference_singular_values(wq_prev, wk_prev, wq_now, wk_now):
    hidden, head_dim = wq_prev.shape[2], wq_prev.shape[1]
    k = min(hidden, 2 * head_dim)
    deltas = reference_deltas(wq_prev, wk_prev, wq_now, wk_now)
    return {
        key: torch.stack([torch.linalg.svdvals(d[i])[:k] for d in deltas]) for i, key in enumerate(QK_DELTA_KEYS)
    }


def assert_spectra_close(est, ref, what="", method="compressed"):
    rel_floor, abs_tol = TOLERANCES[method]
    assert est.shape == ref.shape, (what, est.shape, ref.shape)
    assert est.dtype == torch.float64
    assert torch.isfinite(est).all(), what
    top = ref.amax(dim=-1, keepdim=True)
    abs_err = (est - ref).abs()
    assert (abs_err <= abs_tol * top + 1e-300).all(), (what, (abs_err / top.clamp_min(1e-300)).max())
    mask = ref >= rel_floor * top
    mask &= top > 0
    if mask.any():
        rel = abs_err[mask] / ref[mask]
        assert rel.max() <= REL_TOL, (what, rel.max())


def make_weights(heads, groups, head_dim, hidden, seed, dw_scale=1e-2, dw_rank=None, dtype=torch.float32):
    """W ~ N(0, 0.02); dW = dw_scale * 0.02 * (Gaussian, or a rank-`dw_rank` product)."""
    gen = torch.Generator().manual_seed(seed)

    def one(n):
        w = 0.02 * torch.randn(n, head_dim, hidden, generator=gen, dtype=torch.float64)
        if dw_rank is None:
            dw = torch.randn(n, head_dim, hidden, generator=gen, dtype=torch.float64)
        else:
            a = torch.randn(n, head_dim, dw_rank, generator=gen, dtype=torch.float64)
            b = torch.randn(n, dw_rank, hidden, generator=gen, dtype=torch.float64)
            dw = a @ b / math.sqrt(dw_rank)
        return w.to(dtype), (w + dw_scale * 0.02 * dw).to(dtype)

    wq_prev, wq_now = one(heads)
    wk_prev, wk_now = one(groups)
    return wq_prev, wk_prev, wq_now, wk_now


@st.composite
def qk_configs(draw):
    heads = draw(st.integers(1, 8))
    groups = draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))
    head_dim = draw(st.integers(2, 16))
    hidden = draw(st.integers(16, 96))
    seed = draw(st.integers(0, 2**31 - 1))
    dw_scale = draw(st.sampled_from([1e-4, 1e-2, 1.0]))
    dw_rank = draw(st.sampled_from([None, None, 1, 3]))
    return heads, groups, head_dim, hidden, seed, dw_scale, dw_rank


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=qk_configs())
def test_methods_match_dense_reference(cfg):
    heads, groups, head_dim, hidden, seed, dw_scale, dw_rank = cfg
    weights = make_weights(heads, groups, head_dim, hidden, seed, dw_scale, dw_rank)
    ref = reference_singular_values(*weights)
    k = min(hidden, 2 * head_dim)
    for method in ALL_METHODS:
        got = qk_increment_singular_values(*weights, method=method)
        assert set(got) == set(QK_DELTA_KEYS)
        for key in QK_DELTA_KEYS:
            assert got[key].shape == (heads, k)
            assert (got[key][..., :-1] >= got[key][..., 1:]).all(), "not descending"
            assert_spectra_close(got[key], ref[key], f"{method}/{key} cfg={cfg}", method)


@pytest.mark.parametrize("method", FAST_METHODS)
@pytest.mark.parametrize("heads,groups", [(8, 2), (6, 1), (4, 4)])
def test_gqa_mqa_share_k_groups(method, heads, groups):
    weights = make_weights(heads, groups, 8, 48, seed=heads * 10 + groups)
    ref = reference_singular_values(*weights)
    got = qk_increment_singular_values(*weights, method=method)
    for key in QK_DELTA_KEYS:
        assert_spectra_close(got[key], ref[key], f"{method}/{key}", method)


@pytest.mark.parametrize("method", FAST_METHODS)
@pytest.mark.parametrize("head_dim,hidden", [(16, 20), (8, 6)])
def test_rank_deficient_hidden_smaller_than_two_head_dims(method, head_dim, hidden):
    weights = make_weights(4, 2, head_dim, hidden, seed=3)  # hidden < 2 * head_dim: X rank deficient
    ref = reference_singular_values(*weights)
    got = qk_increment_singular_values(*weights, method=method)
    for key in QK_DELTA_KEYS:
        assert got[key].shape == (4, hidden)
        assert_spectra_close(got[key], ref[key], f"{method}/{key}", method)


@pytest.mark.parametrize("method", FAST_METHODS)
def test_duplicated_columns(method):
    wq_prev, wk_prev, wq_now, wk_now = make_weights(2, 1, 8, 40, seed=5)
    # Paper columns of W_q = rows here: duplicate rows in both prev and now and in K.
    for w in (wq_prev, wq_now, wk_prev, wk_now):
        w[:, 4:] = w[:, :4]
    ref = reference_singular_values(wq_prev, wk_prev, wq_now, wk_now)
    got = qk_increment_singular_values(wq_prev, wk_prev, wq_now, wk_now, method=method)
    for key in QK_DELTA_KEYS:
        assert_spectra_close(got[key], ref[key], f"{method}/{key}", method)
        assert (got[key][:, 8:] <= TOLERANCES[method][1] * got[key][:, :1]).all()  # true rank <= 8


@pytest.mark.parametrize("method", ALL_METHODS)
def test_zero_increment_gives_zero_spectra(method):
    wq, wk, _, _ = make_weights(4, 2, 8, 32, seed=1)
    got = qk_increment_singular_values(wq, wk, wq.clone(), wk.clone(), method=method)
    for key in QK_DELTA_KEYS:
        assert torch.equal(got[key], torch.zeros(4, 16, dtype=torch.float64)), key


@pytest.mark.parametrize("method", FAST_METHODS)
def test_only_query_moves(method):
    wq_prev, wk_prev, wq_now, _ = make_weights(4, 2, 8, 32, seed=2)
    got = qk_increment_singular_values(wq_prev, wk_prev, wq_now, wk_prev.clone(), method=method)
    ref = reference_singular_values(wq_prev, wk_prev, wq_now, wk_prev.clone())
    assert torch.equal(got["delta3"], torch.zeros_like(got["delta3"]))
    for key in ("delta1", "delta2"):
        assert_spectra_close(got[key], ref[key], f"{method}/{key}", method)
    torch.testing.assert_close(got["delta1"], got["delta2"], rtol=1e-9, atol=0)  # Delta3 = 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", FAST_METHODS)
def test_low_precision_inputs_match_dense_on_upcast_values(method, dtype):
    weights = make_weights(4, 2, 8, 64, seed=7, dw_scale=1e-1, dtype=dtype)
    ref = reference_singular_values(*[w.double() for w in weights])
    got = qk_increment_singular_values(*weights, method=method)
    for key in QK_DELTA_KEYS:
        assert_spectra_close(got[key], ref[key], f"{method}/{key}/{dtype}", method)


def test_delta1_is_delta2_plus_delta3_and_frobenius_identity():
    weights = make_weights(3, 3, 6, 40, seed=11, dw_scale=0.3)
    for d1, d2, d3 in reference_deltas(*weights):
        torch.testing.assert_close(d1, d2 + d3, rtol=0, atol=1e-14)
    ref_fro = torch.stack(
        [torch.stack([torch.linalg.matrix_norm(d, "fro") for d in ds]) for ds in reference_deltas(*weights)]
    )  # [heads, 3]
    for method in FAST_METHODS:
        got = qk_increment_singular_values(*weights, method=method)
        fro = torch.stack([got[key].pow(2).sum(-1).sqrt() for key in QK_DELTA_KEYS], dim=-1)
        torch.testing.assert_close(fro, ref_fro, rtol=1e-12, atol=0)


def _good():
    return make_weights(4, 2, 8, 32, seed=0)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda w: (w[0][0], *w[1:]), r"wq_prev must be 3-D"),
        (lambda w: (w[0], w[1][0], *w[2:]), r"wk_prev must be 3-D"),
        (lambda w: (w[0], w[1], w[2][:, :, :-1], w[3]), r"wq_prev and wq_now must have the same shape"),
        (lambda w: (w[0], w[1], w[2], w[3][:1]), r"wk_prev and wk_now must have the same shape"),
        (lambda w: (w[0], w[1][:, :4], w[2], w[3][:, :4]), r"wk_prev must be \[num_groups, head_dim=8"),
        (
            lambda w: (w[0], w[1].repeat(2, 1, 1)[:3], w[2], w[3].repeat(2, 1, 1)[:3]),
            r"num_heads .* divisible by num_groups",
        ),
        (lambda w: (w[0].long(), *w[1:]), r"wq_prev must have a real floating-point dtype"),
    ],
)
def test_shape_errors_name_the_argument(mutate, match):
    with pytest.raises(ValueError, match=match):
        qk_increment_singular_values(*mutate(_good()))


def test_unknown_method():
    with pytest.raises(ValueError, match=r"method must be one of \('dense', 'compressed', 'gram'\)"):
        qk_increment_singular_values(*_good(), method="svd")


@pytest.mark.parametrize("index,name", [(0, "wq_prev"), (1, "wk_prev"), (2, "wq_now"), (3, "wk_now")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_name_the_input(index, name, bad):
    weights = list(_good())
    weights[index][0, 0, 0] = bad
    with pytest.raises(ValueError, match=rf"{name} contains 1 non-finite .*non-finite weights"):
        qk_increment_singular_values(*weights, method="gram")


def test_assume_finite_skips_only_the_nan_check():
    """The session checks finiteness once per layer and tells the kernels (one host sync less each)."""
    g = torch.Generator().manual_seed(5)
    wq0, wk0 = torch.randn(4, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)
    wq1, wk1 = wq0 + 0.01 * torch.randn(4, 8, 32, generator=g), wk0 + 0.01 * torch.randn(2, 8, 32, generator=g)
    checked = qk_increment_singular_values(wq0, wk0, wq1, wk1, method="gram")
    trusted = qk_increment_singular_values(wq0, wk0, wq1, wk1, method="gram", assume_finite=True)
    for key in checked:
        assert torch.equal(checked[key], trusted[key])
    bad = wq1.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        qk_increment_singular_values(wq0, wk0, bad, wk1, method="gram")
