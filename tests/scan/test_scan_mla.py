"""mechmon-scan on multi-head latent attention (MLA) checkpoints: the weights of megatron-core's own
``MLASelfAttention`` (with and without a query latent) before and after an Adam step, saved as
Megatron-LM legacy files (with ``args``), as ``torch_dist`` (no args: the dims come from the
shapes and ``--num-attention-heads``), as Hugging Face DeepSeek-V3-named safetensors (RoPE
channels permuted as Hugging Face does) and as DeepSpeed files with those names. The scan's
scalars are the live session's on the same weights (names and values), its per-head content and
whole Delta2 entropies equal a dense float64 reference, and broken layers are refused naming the
key and the shape expected.
"""

from __future__ import annotations

import math
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from mechmon_megatron.monitors.spectral import spectral_stats
from mechmon_megatron.scan import ScanConfig, ScanInputError, run_scan
from tests.monitors.test_mla_increment import dense_singular_values
from tests.scan import variant_checkpoints as V

pytest.importorskip("megatron.core")

from tests.megatron_core.test_mla_layout import (  # noqa: E402
    D_NOPE,
    D_ROPE,
    D_V,
    HEADS,
    HIDDEN,
    R_KV,
    R_Q,
    _mla_module,
    _weights,
)
from tests.megatron_core.test_qk_norm_and_mla_sites import _site  # noqa: E402

ALPHA = 2.0
EARLIER, LATER = 10, 20


class _Run:
    """One MLA module across one optimizer step: its states, the live scalars, the kernel inputs."""

    def __init__(self, q_lora_rank: int | None) -> None:
        module = _mla_module(q_lora_rank)
        sites, left, _ = _site(module)
        assert not left
        self.q_lora_rank = q_lora_rank
        self.states = {EARLIER: V.module_state(module)}
        self.weights = [_weights(module)]
        x = torch.randn(3, 2, HIDDEN)

        def loss() -> torch.Tensor:
            query, key = module.get_query_key_value_tensors(x, None)[:2]
            return query.pow(2).sum() + (query * key).sum()

        self.live, _, _ = V.live_scalars(sites[0], V.adam_step(module, loss), ALPHA)
        self.states[LATER] = V.module_state(module)
        self.weights.append(_weights(module))

    def args(self, **changes) -> Namespace:
        """Megatron-LM's args for this layer (as a legacy checkpoint stores them)."""
        values = dict(num_attention_heads=HEADS, multi_latent_attention=True, qk_head_dim=D_NOPE,
                      qk_pos_emb_head_dim=D_ROPE, v_head_dim=D_V, q_lora_rank=self.q_lora_rank, kv_lora_rank=R_KV,
                      kv_channels=HIDDEN // HEADS, normalization="RMSNorm", apply_layernorm_1p=False)
        return Namespace(**(values | changes))

    def hf_config(self, **changes) -> dict:
        values = dict(model_type="deepseek_v3", num_attention_heads=HEADS, num_key_value_heads=HEADS,
                      qk_nope_head_dim=D_NOPE, qk_rope_head_dim=D_ROPE, v_head_dim=D_V, q_lora_rank=self.q_lora_rank,
                      kv_lora_rank=R_KV, head_dim=D_ROPE, hidden_size=HIDDEN)
        return values | changes

    def hf_states(self) -> dict[int, V.State]:
        return {i: V.rope_permuted(s, HEADS, D_NOPE, D_ROPE, R_KV) for i, s in self.states.items()}


@pytest.fixture(scope="module", params=[R_Q, None], ids=["q_latent", "q_proj"])
def run(request, model_parallel) -> _Run:
    return _Run(request.param)


def _write(run: _Run, fmt: str, root: Path) -> tuple[Path, dict]:
    """The series in ``fmt`` and the ScanConfig keywords it needs."""
    if fmt == "legacy":
        return V.write_legacy(root, run.states, run.args()), {}
    if fmt == "torch_dist":
        return V.write_torch_dist(root, run.states), {"num_attention_heads": HEADS}
    if fmt == "deepspeed":  # no config: the dims from the shapes
        return V.write_deepspeed(root, run.hf_states(), V.MLA_HF_NAMES), {"num_attention_heads": HEADS}
    return V.write_hf(root, run.hf_states(), run.hf_config(), V.MLA_HF_NAMES), {}


def _scan(root: Path, out: Path, **flags) -> dict[str, float]:
    summary = run_scan(ScanConfig(inputs=(str(root),), out=str(out), alpha=ALPHA, progress=False, **flags))
    assert summary["checkpoints"] == [EARLIER, LATER] and summary["layers"] == [1]
    return V.scan_values(out, LATER)


def _dense_entropies(run: _Run) -> dict[str, torch.Tensor]:
    ref = dense_singular_values(run.weights[0], run.weights[1], D_NOPE, D_ROPE, HEADS)
    return {stream: spectral_stats(values, alpha=ALPHA)["entropy"] for stream, values in ref.items()}


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist", "hf", "deepspeed"])
def test_mla_scan_equals_the_live_session_and_the_dense_reference(run, fmt, tmp_path):
    root, flags = _write(run, fmt, tmp_path / "run")
    got = _scan(root, tmp_path / "out", **flags)
    # Every scalar the live session writes for this layer, and only those: the content stream's
    # delta2_entropy family, the whole stream, the full-matrix dW of the two projections from the hidden state.
    assert set(got) == set(run.live)
    assert f"mechmon/attn/delta2_whole_entropy/layer_1/head_{HEADS - 1}" in got
    assert "mechmon/attn/dw_entropy/layer_1" in got and "mechmon/attn/delta1_entropy/layer_1" not in got
    if fmt in ("legacy", "torch_dist"):  # the module's weights bit for bit, through the same kernels
        assert got == run.live
    else:  # Hugging Face's RoPE permutation changes the order of float64 sums only
        bad = {k: (got[k], v) for k, v in run.live.items() if not math.isclose(got[k], v, rel_tol=1e-12, abs_tol=0)}
        assert not bad, sorted(bad.items())[:4]
    dense = _dense_entropies(run)
    for head in range(HEADS):
        for name, stream in (("delta2_entropy", "content"), ("delta2_whole_entropy", "whole")):
            value = got[f"mechmon/attn/{name}/layer_1/head_{head}"]
            assert math.isclose(value, float(dense[stream][head]), rel_tol=1e-5), (name, head)
    assert not math.isclose(got["mechmon/attn/delta2_entropy/layer_1"],
                            got["mechmon/attn/delta2_whole_entropy/layer_1"], rel_tol=1e-3)  # two streams


def test_mla_summary_records_the_dims(run, tmp_path):
    root, _ = _write(run, "hf", tmp_path / "run")
    summary = run_scan(ScanConfig(inputs=(str(root),), out=str(tmp_path / "out"), progress=False))
    heads = summary["heads"]["1"]
    assert heads["num_heads"] == HEADS and heads["head_dim"] == D_NOPE + D_ROPE
    assert heads["mla"] == {"qk_head_dim": D_NOPE, "qk_pos_emb_head_dim": D_ROPE, "v_head_dim": D_V,
                            "q_lora_rank": run.q_lora_rank, "kv_lora_rank": R_KV}
    has_norms = "kv_layernorm.weight" in run.states[EARLIER]  # the module has latent norms with a query latent
    assert heads.get("norm") == ({"normalization": "RMSNorm", "zero_centered_gamma": False} if has_norms else None)


def _shard_rows(name: str, tensor: torch.Tensor, rank: int, tp: int, replicated: set[str]) -> torch.Tensor:
    if tensor.dim() == 1 or name in replicated:
        return tensor
    return tensor.chunk(tp, dim=0)[rank]


@pytest.mark.parametrize("down", ["replicated", "row_shards"])
def test_mla_legacy_tensor_parallel_shards_read_as_one_layer(run, down, tmp_path):
    """TP = 2 rank files: up projections (and ``linear_q_proj``) split by head; the down projections
    replicated (Transformer Engine's duplicated linear) or row shards (the local spec)."""
    downs = {"linear_q_down_proj.weight", "linear_kv_down_proj.weight"} if down == "replicated" else set()
    root = V.write_legacy(tmp_path / "tp2", run.states, run.args(), tp=2,
                          shard=lambda n, t, r, tp: _shard_rows(n, t, r, tp, downs))
    got = _scan(root, tmp_path / "out")
    want = _scan(V.write_legacy(tmp_path / "tp1", run.states, run.args()), tmp_path / "ref")
    assert set(got) == set(want)
    assert all(math.isclose(got[k], v, rel_tol=1e-12, abs_tol=1e-12) for k, v in want.items())


# ------------------------------------------------------------------------------------ bad input
def _refused(root: Path, out: Path, **flags) -> str:
    with pytest.raises(ScanInputError) as info:
        run_scan(ScanConfig(inputs=(str(root),), out=str(out), progress=False, **flags))
    assert not out.exists()  # refused before anything is written
    return str(info.value)


def test_mla_without_key_up_projection_names_the_key_and_its_shape(run, tmp_path):
    states = {i: {k: v for k, v in s.items() if k != "linear_kv_up_proj.weight"} for i, s in run.states.items()}
    message = _refused(V.write_legacy(tmp_path / "legacy", states, run.args()), tmp_path / "out")
    assert "'decoder.layers.0.self_attention.linear_kv_up_proj.weight'" in message
    assert "[num_heads * (qk_head_dim + v_head_dim), kv_lora_rank]" in message
    states = {i: {k: v for k, v in s.items() if k != "linear_kv_up_proj.weight"} for i, s in run.hf_states().items()}
    message = _refused(V.write_hf(tmp_path / "hf", states, run.hf_config(), V.MLA_HF_NAMES), tmp_path / "out")
    assert "'model.layers.0.self_attn.kv_b_proj.weight'" in message and "expected a tensor of shape" in message


def test_mla_inconsistent_shapes_name_the_key_and_the_expected_shape(run, tmp_path):
    bad = {i: s | {"linear_kv_up_proj.weight": s["linear_kv_up_proj.weight"][:, :-1]} for i, s in run.states.items()}
    message = _refused(V.write_hf(tmp_path / "hf", bad, run.hf_config(), V.MLA_HF_NAMES), tmp_path / "out")
    rows = HEADS * (D_NOPE + D_V)
    assert f"'model.layers.0.self_attn.kv_b_proj.weight' has shape ({rows}, {R_KV - 1}), expected ({rows}, {R_KV})" \
        in message and "config.json" in message
    # A dim in the args that the tensors contradict: the tensor it sizes is named.
    message = _refused(V.write_legacy(tmp_path / "legacy", run.states, run.args(v_head_dim=D_V + 2)), tmp_path / "o2")
    assert f"'decoder.layers.0.self_attention.linear_kv_up_proj.weight' has shape ({rows}, {R_KV}), expected " \
           f"({HEADS * (D_NOPE + D_V + 2)}, {R_KV})" in message and "args in" in message
    # The same from a flag, on a checkpoint without args.
    message = _refused(V.write_torch_dist(tmp_path / "dist", run.states), tmp_path / "o3", num_attention_heads=HEADS,
                       qk_pos_emb_head_dim=D_ROPE + 2)
    assert "linear_kv_down_proj.weight' has shape" in message and "--qk-pos-emb-head-dim" in message


def test_fp8_weights_are_refused(run, tmp_path):
    fp8 = {i: s | {"linear_kv_up_proj.weight": s["linear_kv_up_proj.weight"].to(torch.float8_e4m3fn)}
           for i, s in run.hf_states().items()}
    message = _refused(V.write_hf(tmp_path / "hf", fp8, run.hf_config(), V.MLA_HF_NAMES), tmp_path / "out")
    assert "'model.layers.0.self_attn.kv_b_proj.weight' is stored as torch.float8_e4m3fn" in message
    assert "dequantise FP8 checkpoints first" in message


def test_mla_needs_the_head_count_and_refuses_layernorm_latents(run, tmp_path):
    message = _refused(V.write_torch_dist(tmp_path / "dist", run.states), tmp_path / "out")
    assert "multi-head latent attention" in message and "--num-attention-heads" in message
    legacy = V.write_legacy(tmp_path / "legacy", run.states, run.args(normalization="LayerNorm"))
    if "kv_layernorm.weight" in run.states[EARLIER]:
        message = _refused(legacy, tmp_path / "out")
        assert "LayerNorms" in message and "centring is not folded for MLA" in message
    else:  # no latent norm: nothing to fold, whatever its kind
        assert _scan(legacy, tmp_path / "out")
