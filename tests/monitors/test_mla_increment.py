"""MLA Delta2 spectra (monitors/mla_increment.py) against a dense float64 reference built here:
the effective per-head projections A_h, B_h formed explicitly, the hidden x hidden Delta2 built
and passed to torch.linalg.svdvals.

Tolerance (``assert_spectra_close``), per row with largest reference value ``top``: relative
error <= 1e-5 for reference values >= 1e-6 * top, and every value (incl. the zero-padded tail)
within 1e-9 * top (no spurious values).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechmon_megatron.monitors import MLAWeights, mla_delta2_singular_values
from mechmon_megatron.monitors.mla_increment import MLA_STREAM_KEYS

REL_TOL = 1e-5
REL_FLOOR = 1e-6
ABS_TOL = 1e-9


# ------------------------------------------------------------------------------------------------
# Dense reference (the formulas of the module docstring, nothing shared with the kernel)
# ------------------------------------------------------------------------------------------------


def effective_projections(w: MLAWeights, d_nope: int, d_rope: int, num_heads: int):
    """A, B as float64 [num_heads, d_nope + d_rope, hidden] (row layout)."""
    d_qk = d_nope + d_rope
    if w.q_proj is not None:
        a = w.q_proj.double().reshape(num_heads, d_qk, -1)
    else:
        r_q = w.q_down.shape[0]
        g = torch.ones(r_q, dtype=torch.float64) if w.q_norm is None else w.q_norm.double()
        a = w.q_up.double().reshape(num_heads, d_qk, r_q) @ (g[:, None] * w.q_down.double())
    r_kv = w.kv_up.shape[1]
    g = torch.ones(r_kv, dtype=torch.float64) if w.kv_norm is None else w.kv_norm.double()
    kup = w.kv_up.double().reshape(num_heads, -1, r_kv)[:, :d_nope]
    kvd = w.kv_down.double()
    b_nope = kup @ (g[:, None] * kvd[:r_kv])
    b_rope = kvd[r_kv:].expand(num_heads, d_rope, kvd.shape[1])
    return a, torch.cat([b_nope, b_rope], dim=1)


def dense_singular_values(prev: MLAWeights, now: MLAWeights, d_nope: int, d_rope: int, num_heads: int):
    """Reference: hidden x hidden Delta2_h = dA^T B + A^T dB per head and stream, svdvals, float64."""
    a0, b0 = effective_projections(prev, d_nope, d_rope, num_heads)
    a1, b1 = effective_projections(now, d_nope, d_rope, num_heads)
    da, db = a1 - a0, b1 - b0
    out = {}
    for key, rows in (("content", slice(0, d_nope)), ("whole", slice(None))):
        delta2 = da[:, rows].mT @ b0[:, rows] + a0[:, rows].mT @ db[:, rows]  # [n_h, H, H]
        out[key] = torch.linalg.svdvals(delta2)
    return out


def assert_spectra_close(est, ref, what=""):
    """``ref`` is the full dense spectrum; ``est`` must match its first k values, and the rest of
    ``ref`` must be round-off (k is a rank bound)."""
    k = est.shape[-1]
    assert est.dtype == torch.float64, what
    assert torch.isfinite(est).all(), what
    top = ref.amax(dim=-1, keepdim=True)
    assert (ref[..., k:] <= ABS_TOL * top + 1e-300).all(), (what, "rank bound k too small")
    ref = ref[..., :k]
    abs_err = (est - ref).abs()
    assert (abs_err <= ABS_TOL * top + 1e-300).all(), (what, (abs_err / top.clamp_min(1e-300)).max())
    mask = (ref >= REL_FLOOR * top) & (top > 0)
    if mask.any():
        rel = abs_err[mask] / ref[mask]
        assert rel.max() <= REL_TOL, (what, rel.max())


# ------------------------------------------------------------------------------------------------
# Random layers
# ------------------------------------------------------------------------------------------------


def make_layer(
    *,
    hidden=40,
    num_heads=3,
    r_q: int | None = 12,
    r_kv=8,
    d_nope=6,
    d_rope=3,
    d_v=5,
    gammas=True,
    seed=0,
    dw_scale=1e-2,
    dw_rank: int | None = None,
    dtype=torch.float32,
):
    """(prev, now) MLAWeights: W ~ N(0, 0.02), gamma ~ 1 + N(0, 0.1); dW = dw_scale * RMS(W) *
    (Gaussian, or a rank-``dw_rank`` product); gamma moves by dw_scale * 0.1 * N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def pair(*shape, w_std=0.02, base=0.0):
        w = base + w_std * torch.randn(*shape, generator=gen, dtype=torch.float64)
        if dw_rank is None or len(shape) == 1:
            dw = torch.randn(*shape, generator=gen, dtype=torch.float64)
        else:
            left = torch.randn(shape[0], dw_rank, generator=gen, dtype=torch.float64)
            dw = left @ torch.randn(dw_rank, shape[1], generator=gen, dtype=torch.float64) / math.sqrt(dw_rank)
        return w.to(dtype), (w + dw_scale * w_std * dw).to(dtype)

    d_qk = d_nope + d_rope
    t: dict[str, tuple] = {
        "kv_down": pair(r_kv + d_rope, hidden),
        "kv_up": pair(num_heads * (d_nope + d_v), r_kv),
    }
    if gammas:
        t["kv_norm"] = pair(r_kv, w_std=0.1, base=1.0)
    if r_q is None:
        t["q_proj"] = pair(num_heads * d_qk, hidden)
    else:
        t["q_down"] = pair(r_q, hidden)
        t["q_up"] = pair(num_heads * d_qk, r_q)
        if gammas:
            t["q_norm"] = pair(r_q, w_std=0.1, base=1.0)
    prev = MLAWeights(**{name: p[0] for name, p in t.items()})
    now = MLAWeights(**{name: p[1] for name, p in t.items()})
    return prev, now


def check_against_dense(prev, now, *, d_nope, d_rope, num_heads, head_chunk=16, what=""):
    got = mla_delta2_singular_values(
        prev, now, d_nope=d_nope, d_rope=d_rope, num_heads=num_heads, head_chunk=head_chunk
    )
    ref = dense_singular_values(prev, now, d_nope, d_rope, num_heads)
    assert set(got) == set(MLA_STREAM_KEYS)
    for key in MLA_STREAM_KEYS:
        assert got[key].shape[0] == num_heads, (what, key)
        assert (got[key][..., :-1] >= got[key][..., 1:]).all(), (what, key, "not descending")
        assert_spectra_close(got[key], ref[key], f"{what}/{key}")
    return got


# ------------------------------------------------------------------------------------------------
# Exactness
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r_q", [12, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("gammas", [True, False], ids=["gamma", "no_gamma"])
@pytest.mark.parametrize("num_heads", [1, 4])
def test_matches_dense_reference(r_q, gammas, num_heads):
    prev, now = make_layer(num_heads=num_heads, r_q=r_q, gammas=gammas, seed=num_heads + 10 * (r_q is None))
    got = check_against_dense(prev, now, d_nope=6, d_rope=3, num_heads=num_heads, what=f"{r_q}/{gammas}")
    # k: min(H, 2 d_qk, 2 n_kv[, 2 r_q]) and min(H, 2 d_nope, 2 r_kv[, 2 r_q]).
    assert got["whole"].shape == (num_heads, 18)
    assert got["content"].shape == (num_heads, 12)


@pytest.mark.parametrize(
    "sizes",
    [
        dict(hidden=16, r_q=12, r_kv=8),  # hidden < 2 r_q: the query basis is rank deficient
        dict(hidden=40, r_q=4, r_kv=8),  # r_q < d_qk: the latent bounds the rank (k = 2 r_q = 8)
        dict(hidden=40, r_q=12, r_kv=2),  # r_kv < d_nope: content rank <= 2 r_kv
        dict(hidden=10, r_q=None, r_kv=8),  # hidden < 2 d_qk
        dict(hidden=40, r_q=12, r_kv=8, d_rope=0),  # no RoPE rows: whole == content
    ],
)
def test_rank_bounds_and_degenerate_sizes(sizes):
    d_rope = sizes.pop("d_rope", 3)
    prev, now = make_layer(num_heads=3, d_rope=d_rope, seed=3, **sizes)
    got = check_against_dense(prev, now, d_nope=6, d_rope=d_rope, num_heads=3, what=str(sizes))
    if d_rope == 0:
        torch.testing.assert_close(got["whole"], got["content"], rtol=1e-12, atol=0)


@pytest.mark.parametrize("r_q", [12, None], ids=["q_lora", "q_proj"])
def test_head_chunk_does_not_change_results(r_q):
    prev, now = make_layer(num_heads=7, r_q=r_q, seed=4)
    runs = [
        mla_delta2_singular_values(prev, now, d_nope=6, d_rope=3, num_heads=7, head_chunk=chunk)
        for chunk in (1, 3, 7, 100)
    ]
    for other in runs[1:]:
        for key in MLA_STREAM_KEYS:
            torch.testing.assert_close(other[key], runs[0][key], rtol=1e-12, atol=1e-14 * runs[0][key].max())


def test_rope_key_is_shared_by_all_heads():
    """Moving only kv_down's RoPE rows changes every head's whole stream, no content stream."""
    prev, now = make_layer(num_heads=4, seed=5)
    base = mla_delta2_singular_values(prev, now, d_nope=6, d_rope=3, num_heads=4)
    kv_down = now.kv_down.clone()
    kv_down[8:] += 0.05 * torch.randn(kv_down[8:].shape, generator=torch.Generator().manual_seed(1))
    moved = dataclasses.replace(now, kv_down=kv_down)
    got = check_against_dense(prev, moved, d_nope=6, d_rope=3, num_heads=4, what="rope moved")
    torch.testing.assert_close(got["content"], base["content"], rtol=1e-12, atol=0)
    assert ((got["whole"] - base["whole"]).abs().amax(dim=-1) > 1e-3 * base["whole"][:, :1].squeeze(-1)).all()


def test_value_rows_do_not_matter():
    prev, now = make_layer(num_heads=3, seed=6, d_v=5)
    base = mla_delta2_singular_values(prev, now, d_nope=6, d_rope=3, num_heads=3)
    kv_up = now.kv_up.clone().reshape(3, 11, 8)
    kv_up[:, 6:] = 7.0  # the d_v value rows of every head
    got = mla_delta2_singular_values(
        prev, dataclasses.replace(now, kv_up=kv_up.reshape(33, 8)), d_nope=6, d_rope=3, num_heads=3
    )
    for key in MLA_STREAM_KEYS:
        assert torch.equal(got[key], base[key])


def test_zero_increment_gives_zero_spectra():
    prev, _ = make_layer(num_heads=2, seed=7)
    got = mla_delta2_singular_values(prev, prev, d_nope=6, d_rope=3, num_heads=2)
    for key in MLA_STREAM_KEYS:
        assert torch.equal(got[key], torch.zeros_like(got[key])), key


@pytest.mark.parametrize("r_q", [12, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_match_dense_on_upcast_values(dtype, r_q):
    prev, now = make_layer(num_heads=3, r_q=r_q, seed=8, dw_scale=0.1, dtype=dtype)
    assert prev.kv_down.dtype == dtype
    check_against_dense(prev, now, d_nope=6, d_rope=3, num_heads=3, what=str(dtype))


def test_small_low_rank_increment():
    """A rank-1 dW at 1e-4 of W: the latent differences must keep their own relative accuracy."""
    prev, now = make_layer(num_heads=3, seed=9, dw_scale=1e-4, dw_rank=1, dtype=torch.float64)
    check_against_dense(prev, now, d_nope=6, d_rope=3, num_heads=3, what="rank-1 dW")


@st.composite
def mla_configs(draw):
    return dict(
        hidden=draw(st.integers(8, 64)),
        num_heads=draw(st.integers(1, 5)),
        r_q=draw(st.sampled_from([None, 2, 5, 16])),
        r_kv=draw(st.integers(1, 12)),
        d_nope=draw(st.integers(1, 8)),
        d_rope=draw(st.integers(0, 4)),
        d_v=draw(st.integers(0, 4)),
        gammas=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
        dw_scale=draw(st.sampled_from([1e-4, 1e-2, 1.0])),
        dw_rank=draw(st.sampled_from([None, None, 1, 2])),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=mla_configs(), head_chunk=st.integers(1, 6))
def test_random_layers_match_dense(cfg, head_chunk):
    prev, now = make_layer(dtype=torch.float64, **cfg)
    check_against_dense(
        prev,
        now,
        d_nope=cfg["d_nope"],
        d_rope=cfg["d_rope"],
        num_heads=cfg["num_heads"],
        head_chunk=head_chunk,
        what=str(cfg),
    )


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def _call(prev, now, **kw):
    args = dict(d_nope=6, d_rope=3, num_heads=3) | kw
    return mla_delta2_singular_values(prev, now, **args)


def _with(w, **changes):
    return dataclasses.replace(w, **changes)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (
            lambda p, n: (_with(p, kv_down=p.kv_down[:-1]), n),
            r"prev.kv_down must be \[kv_lora_rank \+ d_rope, hidden\] = \[8 \+ 3, 40\], got \(10, 40\)",
        ),
        (lambda p, n: (p, _with(n, kv_down=n.kv_down[:, :-1])), r"now.kv_down must be .* got \(11, 39\)"),
        (lambda p, n: (p, _with(n, q_down=n.q_down[:, :-1])), r"now.q_down must be \[q_lora_rank, hidden\]"),
        (
            lambda p, n: (_with(p, q_up=p.q_up[:-1]), n),
            r"prev.q_up must be \[num_heads \* \(d_nope \+ d_rope\), q_lora_rank\] = \[3 \* 9, 12\]",
        ),
        (lambda p, n: (p, _with(n, q_norm=n.q_norm[:-1])), r"now.q_norm must be \[q_lora_rank\] = \[12\]"),
        (lambda p, n: (_with(p, kv_norm=p.kv_norm[:-1]), n), r"prev.kv_norm must be \[kv_lora_rank\] = \[8\]"),
        (lambda p, n: (_with(p, kv_up=p.kv_up[:-1]), n), r"prev.kv_up must be \[num_heads \* \(d_nope \+ d_v\)"),
        (lambda p, n: (p, _with(n, kv_up=n.kv_up[:, :-1])), r"now.kv_up must be"),
        (lambda p, n: (_with(p, kv_norm=None), n), r"now.kv_norm is given but prev.kv_norm is None"),
        (lambda p, n: (p, _with(n, q_down=n.q_down[0])), r"now.q_down must be 2-D"),
        (lambda p, n: (_with(p, kv_up=p.kv_up.long()), n), r"prev.kv_up must have a real floating-point dtype"),
        (lambda p, n: (p, "weights"), r"now must be an MLAWeights"),
    ],
)
def test_bad_shapes_name_the_tensor(mutate, match):
    prev, now = make_layer()
    with pytest.raises(ValueError, match=match):
        _call(*mutate(prev, now))


def test_bad_shapes_without_query_latent():
    prev, now = make_layer(r_q=None)
    with pytest.raises(ValueError, match=r"now.q_proj must be \[num_heads \* \(d_nope \+ d_rope\), hidden\]"):
        _call(prev, _with(now, q_proj=now.q_proj[:-2]))
    with pytest.raises(ValueError, match=r"query side needs q_down and q_up .* or q_proj"):
        MLAWeights(kv_down=prev.kv_down, kv_up=prev.kv_up)
    with pytest.raises(ValueError, match=r"either q_proj .* not both"):
        MLAWeights(kv_down=prev.kv_down, kv_up=prev.kv_up, q_proj=prev.q_proj, q_norm=torch.ones(3))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(d_nope=0), r"d_nope must be an int >= 1"),
        (dict(d_rope=-1), r"d_rope must be an int >= 0"),
        (dict(num_heads=0), r"num_heads must be an int >= 1"),
        (dict(head_chunk=0), r"head_chunk must be an int >= 1"),
        (dict(d_rope=4), r"prev.kv_down must be \[kv_lora_rank \+ d_rope, hidden\] = \[8 \+ 4, 40\]"),
        (dict(num_heads=2), r"prev.kv_up must be \[num_heads \* \(d_nope \+ d_v\), kv_lora_rank\]"),
    ],
)
def test_bad_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        _call(*make_layer(), **kw)


def test_non_finite_input_is_named_unless_assumed_finite():
    prev, now = make_layer()
    checked = _call(prev, now)
    trusted = _call(prev, now, assume_finite=True)
    for key in MLA_STREAM_KEYS:
        assert torch.equal(checked[key], trusted[key])
    q_up = now.q_up.clone()
    q_up[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"now.q_up contains 1 non-finite .*non-finite weights"):
        _call(prev, _with(now, q_up=q_up))


# ------------------------------------------------------------------------------------------------
# tools/bench_mla.py at a tiny size
# ------------------------------------------------------------------------------------------------


def test_bench_mla_tiny_json(capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_mla.py"
    spec = importlib.util.spec_from_file_location("bench_mla", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--hidden", "48", "--num-heads", "3", "--q-lora-rank", "8", "--kv-lora-rank", "6"]
    argv += ["--d-nope", "4", "--d-rope", "2", "--d-v", "3", "--repeats", "1", "--head-chunk", "2"]
    report = bench.main(argv + ["--baseline-heads", "2", "--json"])
    assert json.loads(capsys.readouterr().out)["config"] == report["config"]
    assert set(report["times_s"]) == {"mla_latent", "explicit_baseline"}
    assert report["baseline_scaled"] is True and report["max_rel_err"] <= 1e-8
    assert report["spectrum_lengths"] == {"content": 8, "whole": 12}
    no_latent = bench.main(argv[:4] + ["--q-lora-rank", "0"] + argv[6:])  # table output, q_proj path
    assert no_latent["config"]["q_lora_rank"] is None and no_latent["max_rel_err"] <= 1e-8
    assert "speedup" in capsys.readouterr().out
