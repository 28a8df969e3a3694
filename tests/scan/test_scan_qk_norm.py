"""mechmon-scan on QK-norm checkpoints: the weights of megatron-core's own GQA ``SelfAttention``
with ``qk_layernorm`` (RMSNorm and LayerNorm) before and after an Adam step, saved as Megatron-LM
legacy files (norm kind from ``args``), as ``torch_dist`` (from the flags) and with Qwen3 / Gemma 3
names; and an OLMo-2 layer, whose norms span the whole projected query and key. The scan's
scalars are the live session's on the same weights, its per-head Delta2 entropy equals the dense
float64 reference on the folded rows ``diag(gamma) P W`` and differs from the unfolded one.
"""

from __future__ import annotations

import math
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from mechmon_megatron.monitors.norm_fold import fold_norm
from mechmon_megatron.scan import ScanConfig, ScanInputError, run_scan
from mechmon_megatron.session.qkv_layout import qkv_row_indices
from tests.monitors.dense_reference import dense_delta2_entropy
from tests.scan import variant_checkpoints as V

ALPHA = 2.0
EARLIER, LATER = 10, 20
HEADS, GROUPS, HEAD_DIM, HIDDEN = 4, 2, 8, 32  # as tests/megatron_core/test_qk_norm_and_mla_sites.py


def _scan(root: Path, out: Path, **flags) -> dict[str, float]:
    summary = run_scan(ScanConfig(inputs=(str(root),), out=str(out), alpha=ALPHA, progress=False, **flags))
    assert summary["checkpoints"] == [EARLIER, LATER] and summary["layers"] == [1]
    return V.scan_values(out, LATER)


def _per_head(values: dict[str, float]) -> torch.Tensor:
    return torch.tensor([values[f"mechmon/attn/delta2_entropy/layer_1/head_{h}"] for h in range(HEADS)],
                        dtype=torch.float64)


def _args(normalization: str, **changes) -> Namespace:
    return Namespace(**(dict(num_attention_heads=HEADS, group_query_attention=True, num_query_groups=GROUPS,
                             kv_channels=HEAD_DIM, normalization=normalization, qk_layernorm=True) | changes))


# ------------------------------------------------------------------------- megatron-core modules
class _Run:
    """One QK-norm module across one optimizer step: states, live scalars and reads."""

    def __init__(self, normalization: str) -> None:
        from tests.megatron_core.test_qk_norm_and_mla_sites import _qk_norm_attention, _site

        module = _qk_norm_attention(normalization)
        sites, left, _ = _site(module)
        assert not left
        self.normalization = normalization
        self.states = {EARLIER: V.module_state(module)}
        x = torch.randn(6, 2, HIDDEN)

        def loss() -> torch.Tensor:
            query, key = module.get_query_key_value_tensors(x)[:2]
            return query.pow(2).sum() + key.pow(2).sum()

        self.live, self.prev, self.now = V.live_scalars(sites[0], V.adam_step(module, loss), ALPHA)
        self.states[LATER] = V.module_state(module)

    def folded(self) -> torch.Tensor:
        (a, _), (b, _) = self.prev, self.now
        return dense_delta2_entropy(fold_norm(a.wq, a.q_norm), fold_norm(a.wk, a.k_norm),
                                    fold_norm(b.wq, b.q_norm), fold_norm(b.wk, b.k_norm), alpha=ALPHA)

    def unfolded(self) -> torch.Tensor:
        (a, _), (b, _) = self.prev, self.now
        return dense_delta2_entropy(a.wq, a.wk, b.wq, b.wk, alpha=ALPHA)

    def qwen3_states(self, zero_centred: bool = False) -> dict[int, V.State]:
        """Hugging Face names (q_proj, k_proj, v_proj, q_norm, k_norm); with ``zero_centred`` the
        norm weights stored as gamma - 1 (Gemma)."""
        q_rows, k_rows = qkv_row_indices(HEADS, GROUPS, HEAD_DIM)
        out = {}
        for iteration, state in self.states.items():
            qkv = state["linear_qkv.weight"]
            shift = 1.0 if zero_centred else 0.0
            out[iteration] = {"q_proj.weight": qkv[q_rows.reshape(-1)], "k_proj.weight": qkv[k_rows.reshape(-1)],
                              "v_proj.weight": qkv[(k_rows + HEAD_DIM).reshape(-1)],
                              "q_norm.weight": state["q_layernorm.weight"] - shift,
                              "k_norm.weight": state["k_layernorm.weight"] - shift}
        return out


@pytest.fixture(scope="module", params=["RMSNorm", "LayerNorm"])
def run(request, model_parallel) -> _Run:
    return _Run(request.param)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_qk_norm_scan_equals_the_live_session_and_the_folded_reference(run, fmt, tmp_path):
    if fmt == "legacy":  # the norm kind from the stored args
        root, flags = V.write_legacy(tmp_path / "run", run.states, _args(run.normalization)), {}
    else:  # no args: the flags; RMSNorm is the default
        root = V.write_torch_dist(tmp_path / "run", run.states)
        flags = dict(num_attention_heads=HEADS, num_query_groups=GROUPS,
                     normalization="LayerNorm" if run.normalization == "LayerNorm" else None)
    got = _scan(root, tmp_path / "out", **flags)
    assert got == run.live  # the same names, and the same values: the same weights through the same kernels
    torch.testing.assert_close(_per_head(got), run.folded(), rtol=1e-5, atol=0)
    assert (_per_head(got) - run.unfolded()).abs().max() > 1e-3  # without the gammas: another matrix


def test_qk_norm_kind_is_taken_from_the_args(run, tmp_path):
    """The other kind in the args gives other values: the scan does not guess the kind."""
    other = "RMSNorm" if run.normalization == "LayerNorm" else "LayerNorm"
    got = _scan(V.write_legacy(tmp_path / "run", run.states, _args(other)), tmp_path / "out")
    assert abs(got["mechmon/attn/delta2_entropy/layer_1"] - run.live["mechmon/attn/delta2_entropy/layer_1"]) > 1e-4


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3"])
def test_hugging_face_qk_norm_names_read_as_the_megatron_layer(run, model_type, tmp_path):
    """Qwen3 / Gemma 3 names; the LayerNorm module's layer needs ``--normalization LayerNorm`` (those
    models use RMSNorm, the scan's default for Hugging Face folders)."""
    gemma = model_type == "gemma3"  # GemmaRMSNorm multiplies by 1 + weight: the weight stored is gamma - 1
    config = dict(model_type=model_type, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM)
    names = {n: n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_norm.weight", "k_norm.weight")}
    root = V.write_hf(tmp_path / "run", run.qwen3_states(zero_centred=gemma), config, names)
    got = _scan(root, tmp_path / "out", normalization="LayerNorm" if run.normalization == "LayerNorm" else None)
    assert set(got) == set(run.live)
    # gamma - 1 is exact in float32 for gamma in [0.5, 2] (Sterbenz), and + 1 is exact in float64.
    assert all(math.isclose(got[k], v, rel_tol=1e-12, abs_tol=1e-12) for k, v in run.live.items())


def test_zero_centred_gamma_from_the_args(run, tmp_path):
    stored = {i: s | {n: s[n] - 1.0 for n in ("q_layernorm.weight", "k_layernorm.weight")}
              for i, s in run.states.items()}
    root = V.write_legacy(tmp_path / "run", stored, _args(run.normalization, apply_layernorm_1p=True))
    got = _scan(root, tmp_path / "out")
    assert all(math.isclose(got[k], v, rel_tol=1e-12, abs_tol=1e-12) for k, v in run.live.items())
    summary = (tmp_path / "out" / "summary.json").read_text()
    assert '"zero_centered_gamma": true' in summary and f'"normalization": "{run.normalization}"' in summary


# ------------------------------------------------------------------------------------- OLMo-2
def _olmo2_states(seed: int = 0) -> tuple[dict[int, V.State], list[dict[str, torch.Tensor]]]:
    """Two steps of one OLMo-2 layer: q_norm over all heads' channels ``[HEADS * HEAD_DIM]``, k_norm
    over all groups' ``[GROUPS * HEAD_DIM]``, gammas away from 1 and moving."""
    gen = torch.Generator().manual_seed(seed)
    w = {"q_proj.weight": 0.1 * torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen),
         "k_proj.weight": 0.1 * torch.randn(GROUPS * HEAD_DIM, HIDDEN, generator=gen),
         "v_proj.weight": 0.1 * torch.randn(GROUPS * HEAD_DIM, HIDDEN, generator=gen),
         "q_norm.weight": torch.rand(HEADS * HEAD_DIM, generator=gen) + 0.5,
         "k_norm.weight": torch.rand(GROUPS * HEAD_DIM, generator=gen) + 0.5}
    moved = {k: v + 1e-2 * torch.randn(v.shape, generator=gen) for k, v in w.items()}
    return {EARLIER: w, LATER: moved}, [w, moved]


def _olmo2_folded(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``diag(gamma_h) W_h`` per head, gamma_h head h's slice of the whole-projection gamma."""
    wq = state["q_proj.weight"].double().reshape(HEADS, HEAD_DIM, HIDDEN)
    wk = state["k_proj.weight"].double().reshape(GROUPS, HEAD_DIM, HIDDEN)
    gq = state["q_norm.weight"].double().reshape(HEADS, HEAD_DIM, 1)
    gk = state["k_norm.weight"].double().reshape(GROUPS, HEAD_DIM, 1)
    return gq * wq, gk * wk


def _write_olmo2(root: Path, states: dict[int, V.State]) -> Path:
    config = dict(model_type="olmo2", num_attention_heads=HEADS, num_key_value_heads=GROUPS, hidden_size=HIDDEN)
    return V.write_hf(root, states, config, {n: n for n in states[EARLIER]})


def test_olmo2_whole_projection_norm_folds_per_head_slice(tmp_path):
    pytest.importorskip("safetensors")
    states, (before, after) = _olmo2_states()
    got = _scan(_write_olmo2(tmp_path / "run", states), tmp_path / "out")
    ref = dense_delta2_entropy(*_olmo2_folded(before), *_olmo2_folded(after), alpha=ALPHA)
    torch.testing.assert_close(_per_head(got), ref, rtol=1e-5, atol=0)
    assert math.isclose(got["mechmon/attn/delta2_entropy/layer_1"], float(ref.mean()), rel_tol=1e-5)
    assert math.isclose(got["mechmon/attn/delta2_entropy_min/layer_1"], float(ref.min()), rel_tol=1e-5)
    unfolded = dense_delta2_entropy(*(s[n].reshape(-1, HEAD_DIM, HIDDEN) for s in (before, after)
                                      for n in ("q_proj.weight", "k_proj.weight")), alpha=ALPHA)
    assert (_per_head(got) - unfolded).abs().max() > 1e-3
    # The same scalars as any classic layer (Delta1/3, per-head and full-matrix dW), one value each.
    for name in ("delta1_entropy", "delta3_entropy", "dwq_head_entropy", "dwk_head_entropy", "dw_entropy"):
        assert f"mechmon/attn/{name}/layer_1" in got


def test_olmo2_equals_the_same_layer_with_per_head_shared_gammas(tmp_path):
    """Where every head's slice is the same gamma, the whole-projection fold is the per-head one."""
    pytest.importorskip("safetensors")
    states, _ = _olmo2_states(seed=1)
    shared = {i: s | {"q_norm.weight": s["q_norm.weight"][:HEAD_DIM].repeat(HEADS),
                      "k_norm.weight": s["k_norm.weight"][:HEAD_DIM].repeat(GROUPS)} for i, s in states.items()}
    per_head = {i: s | {"q_norm.weight": s["q_norm.weight"][:HEAD_DIM], "k_norm.weight": s["k_norm.weight"][:HEAD_DIM]}
                for i, s in states.items()}
    got = _scan(_write_olmo2(tmp_path / "whole", shared), tmp_path / "o1")
    want = _scan(_write_olmo2(tmp_path / "head", per_head), tmp_path / "o2")
    assert set(got) == set(want)
    assert all(math.isclose(got[k], v, rel_tol=1e-9, abs_tol=1e-12) for k, v in want.items())


def test_whole_projection_layernorm_and_wrong_norm_sizes_are_refused(tmp_path):
    pytest.importorskip("safetensors")
    states, _ = _olmo2_states()
    with pytest.raises(ScanInputError, match="LayerNorm over the whole projection"):
        run_scan(ScanConfig(inputs=(str(_write_olmo2(tmp_path / "run", states)),), out=str(tmp_path / "o1"),
                            normalization="LayerNorm", progress=False))
    bad = {i: s | {"k_norm.weight": s["k_norm.weight"][:5]} for i, s in states.items()}
    with pytest.raises(ScanInputError) as info:
        run_scan(ScanConfig(inputs=(str(_write_olmo2(tmp_path / "bad", bad)),), out=str(tmp_path / "o2"),
                            progress=False))
    assert f"'model.layers.0.self_attn.k_norm.weight' has shape (5,), expected ({HEAD_DIM},)" in str(info.value)
    assert f"or ({GROUPS * HEAD_DIM},)" in str(info.value)
