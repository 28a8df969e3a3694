"""The planner with multi-head latent attention: the MLA kernel's cost, the tensors it snapshots,
the flags, the presets and the measured path."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mechmon_megatron.monitors.mla_increment import MLAWeights, mla_delta2_singular_values
from mechmon_megatron.plan.cli import main
from mechmon_megatron.plan.estimate import step_flops
from mechmon_megatron.plan.flops import mla_heads_cost
from mechmon_megatron.plan.shapes import PRESETS, ParallelLayout, PlanInputError, resolve_shape, validate
from mechmon_megatron.plan.work import rank_work, unit_shapes

ROOT = Path(__file__).resolve().parents[2]
TINY_MLA = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--multi-latent-attention",
            "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
            "--v-head-dim", "8", "--seq-length", "32", "--global-batch-size", "4"]


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _pair(shape, gen):
    w = 0.02 * torch.randn(shape, generator=gen)
    return w, w + 1e-3 * torch.randn(shape, generator=gen)


def _layer(heads, hidden, r_q, r_kv, d_nope, d_rope, gen):
    """prev/now MLA weights with the snapshot's tensors (key rows of kv_up only)."""
    d_qk = d_nope + d_rope
    t = {"kv_down": _pair((r_kv + d_rope, hidden), gen), "kv_up": _pair((heads * d_nope, r_kv), gen),
         "kv_norm": _pair((r_kv,), gen)}
    if r_q is None:
        t["q_proj"] = _pair((heads * d_qk, hidden), gen)
    else:
        t |= {"q_down": _pair((r_q, hidden), gen), "q_up": _pair((heads * d_qk, r_q), gen),
              "q_norm": _pair((r_q,), gen)}
    return MLAWeights(**{k: v[0] for k, v in t.items()}), MLAWeights(**{k: v[1] for k, v in t.items()})


# (heads, hidden, r_q, r_kv, d_nope, d_rope, head_chunk): wide hidden; hidden below 2 r_q and
# 2 n_kv (the latent bases lose rank); no query latent; no RoPE; latents below the head dims.
KERNEL_SHAPES = [(4, 64, 8, 6, 4, 2, 16), (3, 40, 32, 24, 8, 4, 2), (5, 12, 8, 8, 4, 2, 2), (2, 64, None, 6, 4, 2, 16),
                 (4, 9, None, 3, 4, 0, 3), (4, 16, 3, 2, 4, 3, 16)]


@pytest.mark.parametrize(("heads", "hidden", "r_q", "r_kv", "d_nope", "d_rope", "chunk"), KERNEL_SHAPES)
def test_mla_gemm_flops_match_the_kernel(heads, hidden, r_q, r_kv, d_nope, d_rope, chunk):
    prev, now = _layer(heads, hidden, r_q, r_kv, d_nope, d_rope, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        mla_delta2_singular_values(prev, now, d_nope=d_nope, d_rope=d_rope, num_heads=heads, head_chunk=chunk)
    cost = mla_heads_cost(heads, hidden, q_lora_rank=r_q, kv_lora_rank=r_kv, d_nope=d_nope, d_rope=d_rope,
                          weight_bytes=4)
    assert cost.gemm == counter.get_total_flops()


def test_mla_flops_by_hand_for_a_tiny_layer():
    # 3 heads, H 64, r_q 8, r_kv 6, d_nope 4, d_rope 2: d_qk 6, n_kv 8, m_q = m_kv = 16 (H >= 2 r),
    # the factors are [16, 12] (x_w = y_w = 12), the content cores [8, 8]. Terms of the docstring:
    shared = 2 * (2 * 64 * 16**2 - 2 * 16**3 / 3)  # QR (R only) of [H, 2 r_q] and of [H, 2 n_kv]
    query, key = 8 * 8**2 * 6, (8 * 6 + 4 * 2) * 6 * 4  # 8 r_q^2 d_qk; (8 r_kv + 4 d_rope) r_kv d_nope
    cores = 16 * (6**3 + 4**3)
    qrs = 2 * (2 * 16 * 12**2 - 2 * 12**3 / 3)  # [m_q, 2 d_qk] and [m_kv, 2 d_qk]
    svdvals = (2 * 12 * 12**2 + 2 * 12**3) + (2 * 8 * 8**2 + 2 * 8**3)  # whole and content cores
    cost = mla_heads_cost(3, 64, q_lora_rank=8, kv_lora_rank=6, d_nope=4, d_rope=2, weight_bytes=4)
    assert cost.gemm == 3 * (query + key + cores)
    assert cost.factor == pytest.approx(shared + 3 * (qrs + svdvals), rel=1e-12)


def test_mla_flops_agree_with_the_benchmark_count():
    """tools/bench_mla.py counts the same kernel independently (without the cores' svdvals)."""
    spec = importlib.util.spec_from_file_location("bench_mla", ROOT / "tools" / "bench_mla.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for argv, r_q in (([], 1536), (["--q-lora-rank", "0"], None)):  # DeepSeek-V3's layer; without a query latent
        counted = bench.flops(bench.parse_args(argv))["latent_total"]
        cost = mla_heads_cost(128, 7168, q_lora_rank=r_q, kv_lora_rank=512, d_nope=128, d_rope=64, weight_bytes=4)
        svdvals = 128 * ((2 * 384**3 + 2 * 384**3) + (2 * 256**3 + 2 * 256**3))
        assert cost.flops - svdvals == pytest.approx(counted, rel=1e-12)


def _mla_elements(shape, tp: int) -> int:
    """Elements of one layer's MLA tensors on one TP rank: q_down, q gamma, the rank's q_up rows,
    kv_down, kv gamma, the rank's key rows of kv_up."""
    h, heads = shape.hidden_size, shape.num_attention_heads // tp
    r_q, r_kv, d_nope, d_rope = shape.q_lora_rank, shape.kv_lora_rank, shape.qk_head_dim, shape.qk_pos_emb_head_dim
    return (r_q * h + r_q + heads * (d_nope + d_rope) * r_q
            + (r_kv + d_rope) * h + r_kv + heads * d_nope * r_kv)


@pytest.mark.parametrize("tp", [1, 8])
def test_deepseek_v3_snapshot_is_the_mla_tensors(tp, capsys):
    code, out, _ = _run(["--model", "deepseek-v3", "--tp", str(tp), "--no-measure", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    shape = PRESETS["deepseek-v3"]
    # DP 1: the rank does every layer's per-head work; its full-matrix layers (all with TP 1, every
    # eighth with TP 8) need only the down projections, already in its snapshot. FP32.
    assert report["snapshot_bytes_per_rank"] == shape.num_layers * _mla_elements(shape, tp) * 4
    assert sum(report["attention"]["heads_unit_elements"].values()) == _mla_elements(shape, tp)
    comps = report["check_flops_per_rank"]["components"]
    assert comps["attn_heads"]["units"] == shape.num_layers
    per_layer = mla_heads_cost(128 // tp, 7168, q_lora_rank=1536, kv_lora_rank=512, d_nope=128, d_rope=64,
                               weight_bytes=4).flops
    assert comps["attn_heads"]["flops"] == pytest.approx(shape.num_layers * per_layer)
    assert report["check_time_s_per_rank"]["components"]["tp_gather"]["units"] == 0  # down projections replicated


def test_without_a_query_latent_the_full_query_is_gathered(capsys):
    argv = [a for a in TINY_MLA if a not in ("--q-lora-rank", "16")]
    code, out, _ = _run([*argv, "--tp", "2", "--no-measure", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["attention"]["full_unit_shapes"] == {"linear_q_proj": [4 * 12, 64], "linear_kv_down_proj": [12, 64]}
    assert report["attention"]["full_unit_gathered_elements"] == 4 * 12 * 64
    comps = report["check_time_s_per_rank"]["components"]
    assert comps["tp_gather"]["units"] == 2 * comps["attn_full"]["units"] == 4  # layers 1, 3: snapshot and check


def test_snapshot_elements_with_mla_match_a_hand_count():
    # TP 2 x DP 2, 4 layers: layer 1 per-head on dp 0, full on (dp 0, tp 0); layer 2 per-head on
    # dp 1, full on (dp 0, tp 1); layer 3 per-head dp 0, full (dp 1, tp 0); layer 4 dp 1, (dp 1, tp 1).
    shape = resolve_shape(None, dict(num_layers=4, hidden_size=64, num_attention_heads=4, multi_latent_attention=True,
                                     q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                     v_head_dim=8), dp=2)
    layout = ParallelLayout(tp=2, pp=1, dp=2)
    validate(shape, layout)
    u = unit_shapes(shape, layout)
    heads = 16 * 64 + 16 + 2 * 12 * 16 + 12 * 64 + 8 + 2 * 8 * 8
    full = (16 + 12) * 64
    assert (u.heads_elements, u.full_elements) == (heads, full)
    w00 = rank_work(shape, layout, 0, 0, 0)  # per-head layers 1, 3; full layer 1 (its own: shared)
    assert (w00.head_units, w00.full_units, w00.shared_units) == (2, 1, 1)
    assert w00.snapshot_elements(u, overlap=1) == 2 * heads
    w01 = rank_work(shape, layout, 0, 0, 1)  # per-head 1, 3; full layer 2 (per-head on dp 1): its own copy
    assert (w01.head_units, w01.full_units, w01.shared_units) == (2, 1, 0)
    assert w01.snapshot_elements(u, overlap=1) == 2 * heads + full


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        ([], "--kv-lora-rank"),
        (["--kv-lora-rank", "8"], "--qk-head-dim"),
        (["--kv-lora-rank", "0", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8"],
         "--kv-lora-rank"),
    ],
)
def test_mla_without_its_sizes_exits_2_naming_the_flag(extra, flag, capsys):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--multi-latent-attention"]
    code, out, err = _run([*base, *extra, "--no-measure"], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"mechmon-plan: error: {flag} ")


def test_latent_sizes_without_mla_name_the_mla_flag(capsys):
    code, _, err = _run(["--model", "llama3-8b", "--kv-lora-rank", "512", "--no-measure"], capsys)
    assert code == 2 and err.startswith("mechmon-plan: error: --multi-latent-attention ")
    with pytest.raises(PlanInputError, match="^--qk-pos-emb-head-dim ") as info:
        validate(replace(PRESETS["deepseek-v3"], qk_pos_emb_head_dim=-1), ParallelLayout(tp=1, pp=1, dp=1))
    assert info.value.flag == "--qk-pos-emb-head-dim"


def test_deepseek_v3_report_states_mla_not_dense(capsys):
    code, out, _ = _run(["--model", "deepseek-v3", "--dp", "1024", "--ep", "64", "--no-measure"], capsys)
    assert code == 0
    assert "multi-head latent attention (q_lora_rank 1536, kv_lora_rank 512" in out.splitlines()[0]
    assert "dense" not in out
    assert "MLA per-head unit (128 heads" in out and "linear_kv_down_proj [576, 7168]" in out
    _, out, _ = _run(["--model", "deepseek-v3", "--dp", "1024", "--ep", "64", "--no-measure", "--json"], capsys)
    report = json.loads(out)
    assert "dense" not in report["model"]["note"] and report["attention"]["kind"] == "multi-head latent attention"


@pytest.mark.parametrize(("name", "heads", "experts", "first_dense", "published"),
                         [("deepseek-v3", 128, 256, 3, 37e9), ("kimi-k2", 64, 384, 1, 32e9)])
def test_mla_presets(name, heads, experts, first_dense, published):
    s = PRESETS[name]
    assert (s.num_layers, s.hidden_size, s.num_attention_heads, s.num_experts, s.moe_router_topk) == (
        61, 7168, heads, experts, 8)
    assert (s.q_lora_rank, s.kv_lora_rank, s.qk_head_dim, s.qk_pos_emb_head_dim, s.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert s.multi_latent_attention and s.first_dense_layers == first_dense
    assert s.params_per_token() == published
    # The count from the MLA shape (routers and most norms left out) agrees with the published figure.
    assert replace(s, active_params=None).params_per_token() == pytest.approx(published, rel=0.03)


def test_step_time_counts_the_mla_head_widths():
    s = PRESETS["deepseek-v3"]
    tokens = s.global_batch_size * s.seq_length
    attention = 6 * s.num_layers * s.seq_length * 128 * (128 + 64 + 128)  # q.k over d_qk, p.v over d_v
    assert step_flops(s) == pytest.approx(tokens * (6 * 37e9 + attention))


def test_measured_path_times_the_mla_kernel(capsys):
    code, out, _ = _run([*TINY_MLA, "--tp", "2", "--device", "cpu", "--repeats", "1", "--json"], capsys)
    assert code == 0
    comps = json.loads(out)["check_time_s_per_rank"]["components"]
    assert comps["attn_heads"]["label"] == "measured"
    assert comps["attn_heads"]["measured"].startswith("mla_delta2_singular_values(2 heads, hidden 64, q_lora_rank 16")
    assert "linear_q_down_proj [16, 64], linear_kv_down_proj [12, 64]" in comps["attn_full"]["measured"]


def test_an_mla_unit_too_large_for_memory_is_measured_reduced_and_scaled(monkeypatch, capsys):
    from mechmon_megatron.plan import measure

    shape = resolve_shape(None, {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                                 "multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 8,
                                 "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8})
    lat = shape.latent()
    limit = measure.mla_heads_memory(2, 64, lat, 4) + 1  # half the heads fit
    monkeypatch.setattr(measure, "fits", lambda nbytes, device: nbytes <= limit)
    code, out, _ = _run([*TINY_MLA, "--no-full-matrix-dw", "--device", "cpu", "--repeats", "1", "--json"], capsys)
    assert code == 0
    comp = json.loads(out)["check_time_s_per_rank"]["components"]["attn_heads"]
    assert comp["measured"].startswith("mla_delta2_singular_values(2 heads,")
    assert "[reduced to fit memory; scaled x" in comp["measured"]
