"""QK-norm in the DeepSpeed adapter's Hugging Face-style attention layouts.

The modules (``_hf_qk_norm.py``) mirror the Hugging Face layouts of Qwen3, Gemma 3 (zero-centred
gamma), OLMo 2 (one RMSNorm over the whole projection), Cohere (a gamma row per head) and a
per-head ``nn.LayerNorm``: the attribute names, the norm class names and formulas, and where the
norm sits (after the view to heads, or before it for OLMo 2).

* The site's folded rows reproduce each module's own normalised query and key, times the input's
  RMS (per head; over the whole projection for OLMo 2) -- the input-dependent factor the fold
  leaves out.
* On a real DeepSpeed engine (ZeRO-2, and ZeRO-3 when slow tests run; two CPU ranks, gloo)
  across optimizer steps, the recorded per-head Delta2 entropy equals a dense float64 reference
  on the folded rows, and differs from the entropy of the unfolded rows; a layer whose norm is
  not folded is recorded on its unfolded rows, after one warning on rank 0.
* A norm the monitors cannot fold (an unknown class, a name its output contradicts): one start-up
  warning naming the layer and the class; the layer is still monitored, without the fold.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from mechmon_megatron.adapters.deepspeed.attention_layouts import find_attention, parse_mapping
from mechmon_megatron.adapters.deepspeed.engine_hooks import _AttentionReader
from mechmon_megatron.monitors.norm_fold import fold_norm
from mechmon_megatron.session.collective_guard import CollectiveGuard
from mechmon_megatron.session.host import QKWeights
from tests.deepspeed._hf_qk_norm import EPS, HEAD_DIM, HEADS, HIDDEN, KINDS, KV_HEADS, QKNormAttention
from tests.megatron_core._torchrun import REPO_ROOT, run_ranks
from tests.monitors.dense_reference import dense_delta2_entropy

DRIVER = REPO_ROOT / "tests" / "deepspeed" / "_qk_norm_driver.py"
ENGINE_KINDS = ("qwen3", "gemma3", "olmo2", "unknown")  # one layer each; the last is not folded
ALPHA = 1.0


class Model(nn.Module):
    def __init__(self, *attention: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": a}) for a in attention])


def _plain(param: torch.Tensor) -> torch.Tensor:
    return param.detach()


def _heads(attention: nn.Module, mapping=()) -> QKWeights:
    """The site's per-head read of the one attention layer in a model (the owner's)."""
    found = find_attention(Model(attention), parse_mapping(list(mapping), "m") if mapping else ())
    assert len(found) == 1
    reader = _AttentionReader(found[0], owner=True, full_matrix=False, read_param=_plain, guard=CollectiveGuard())
    assert reader.read_full() is None
    heads = reader.read_heads()
    assert isinstance(heads, QKWeights)
    return heads


def _rms(raw: torch.Tensor, centres: bool, whole: bool) -> torch.Tensor:
    """The norm's input-dependent divisor of ``raw`` ``[n, head_dim]`` (``[n, 1]`` or ``[1, 1]``)."""
    if centres:
        raw = raw - raw.mean(dim=1, keepdim=True)
    if whole:
        return torch.sqrt(raw.pow(2).mean() + EPS).reshape(1, 1)
    return torch.sqrt(raw.pow(2).mean(dim=1, keepdim=True) + EPS)


@pytest.mark.parametrize("kind", KINDS)
def test_folded_rows_reproduce_the_modules_normalised_query_and_key(kind: str):
    attention = QKNormAttention(kind)
    heads = _heads(attention)
    # Every kind: the projection's own rows and a NormFold the check folds, as on megatron-core;
    # one gamma row per head where the norm has one (Cohere) or spans the whole projection (OLMo-2).
    assert heads.q_norm is not None and heads.k_norm is not None
    assert heads.q_norm.centres == (kind in ("layernorm", "cohere"))
    assert heads.wq.dtype == torch.float32
    per_head = kind in ("cohere", "olmo2")
    assert heads.q_norm.gamma.shape == ((HEADS, HEAD_DIM) if per_head else (HEAD_DIM,))
    x = torch.randn(HIDDEN)
    with torch.no_grad():
        query, key = attention.query_key(x[None])
    centres = kind in ("layernorm", "cohere")
    for got, rows, norm, proj, n in ((query[0], heads.wq, heads.q_norm, attention.q_proj, HEADS),
                                     (key[0], heads.wk, heads.k_norm, attention.k_proj, KV_HEADS)):
        raw = proj.weight.detach().double().reshape(n, HEAD_DIM, HIDDEN) @ x.double()
        folded = fold_norm(rows, norm).double() @ x.double()  # [n, head_dim]
        if kind == "layernorm":  # the bias adds a term linear in one token, left out of the fold
            got = got - attention.q_norm.bias if n == HEADS else got - attention.k_norm.bias
        scale = _rms(raw, centres, whole=kind == "olmo2")
        torch.testing.assert_close(got.double() * scale, folded, rtol=1e-5, atol=1e-6)


def test_gemma_zero_centred_gamma_adds_one():
    attention = QKNormAttention("gemma3")
    heads = _heads(attention)
    expected = attention.q_norm.weight.detach().double() + 1.0
    torch.testing.assert_close(heads.q_norm.gamma, expected, rtol=0, atol=0)


def test_attention_mapping_names_the_norms():
    """A layout only ``attention_mapping`` describes, with its norms by module or parameter path."""

    class Custom(nn.Module):
        def __init__(self, source: QKNormAttention) -> None:
            super().__init__()
            self.wq, self.wk = source.q_proj, source.k_proj
            self.qn, self.kn = source.q_norm, source.k_norm

    source = QKNormAttention("qwen3")
    entry = {"match": "layers.*.self_attn", "layout": "separate", "q": "wq.weight", "k": "wk.weight",
             "num_heads": HEADS, "num_kv_heads": KV_HEADS, "q_norm": "qn", "k_norm": "kn.weight"}
    heads = _heads(Custom(source), [entry])
    torch.testing.assert_close(heads.q_norm.gamma, source.q_norm.weight.detach())
    torch.testing.assert_close(heads.k_norm.gamma, source.k_norm.weight.detach())
    with pytest.raises(ValueError, match=r"m\[0\]\.q_norm must be a module or parameter path"):
        parse_mapping([{**entry, "q_norm": 3}], "m")
    with pytest.raises(ValueError, match="no norm or parameter 'nope'"):
        _heads(Custom(source), [{**entry, "q_norm": "nope"}])


@pytest.mark.parametrize("kind,cls,why", [("unknown", "HeadScale", "a norm class mechmon does not know"),
                                          ("misnamed", "ScaledRMSNorm", "its output on a probe is not the RMSNorm")])
def test_a_norm_not_folded_warns_once_and_the_layer_stays_monitored(kind: str, cls: str, why: str, caplog):
    model = Model(QKNormAttention(kind), QKNormAttention(kind, seed=1))
    with caplog.at_level(logging.WARNING):
        found = find_attention(model)
    assert [f.name for f in found] == ["layers.0.self_attn", "layers.1.self_attn"]  # still monitored
    assert all(f.q_norm is None and f.k_norm is None for f in found)
    warnings = [r.getMessage() for r in caplog.records if "QK-norm" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "2 attention layer(s)" in warnings[0] and f"layers.0.self_attn.q_norm ({cls}): {why}" in warnings[0]
    heads = _AttentionReader(found[0], owner=True, full_matrix=False, read_param=_plain, guard=CollectiveGuard())
    heads.read_full()
    out = heads.read_heads()
    assert out.q_norm is None and torch.equal(out.wq, model.layers[0]["self_attn"].q_proj.weight.detach().reshape(
        HEADS, HEAD_DIM, HIDDEN))
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        find_attention(model, notice=False)  # ranks other than 0 say nothing
    assert not caplog.records


def test_identity_norms_and_a_gated_q_proj():
    """``nn.Identity`` norms fold nothing; a ``q_proj`` holding more than the queries (Qwen3-Next's
    per-head output gate: ``2 * heads * head_dim`` rows) is not taken for the plain layout."""
    attention = QKNormAttention("qwen3")
    attention.q_norm, attention.k_norm = nn.Identity(), nn.Identity()
    assert _heads(attention).q_norm is None
    gated = QKNormAttention("qwen3")
    gated.q_proj = nn.Linear(HIDDEN, 2 * HEADS * HEAD_DIM, bias=False)
    assert find_attention(Model(gated), notice=False) == []


# ---------------------------------------------------------------------------------- the engine
def _effective(kind: str, w: torch.Tensor, gamma: torch.Tensor, n: int) -> torch.Tensor:
    """``diag(g_h) W_h`` of each head ``[n, head_dim, hidden]`` from the module's own tensors."""
    rows = w.double().reshape(n, HEAD_DIM, HIDDEN)
    g = gamma.double() + (1.0 if kind == "gemma3" else 0.0)  # "unknown" (HeadScale) scales by weight too
    return rows * g.reshape(-1 if kind == "olmo2" else 1, HEAD_DIM, 1)


def _rows_at(weights: dict, step: int, layer: int, kind: str, folded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = weights[step][layer]
    if not folded:
        return w["q_proj"].reshape(HEADS, HEAD_DIM, HIDDEN), w["k_proj"].reshape(KV_HEADS, HEAD_DIM, HIDDEN)
    return (_effective(kind, w["q_proj"], w["q_norm"], HEADS), _effective(kind, w["k_proj"], w["k_norm"], KV_HEADS))


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_engine_per_head_delta2_equals_the_dense_reference_on_folded_rows(tmp_path: Path, stage: int):
    """ZeRO-2: the Q/K and norm weights are read as fp32 master partitions, all-reduced; ZeRO-3:
    partitioned module parameters (detection from ``ds_shape``, no probe, gathered reads)."""
    pytest.importorskip("deepspeed")
    results = run_ranks(DRIVER, [tmp_path, stage, *ENGINE_KINDS], nproc=2, timeout_s=300,
                        env={"DS_ACCELERATOR": "cpu", "MKL_NUM_THREADS": "1"})
    for result in results:
        result.check()
    warning = "[mechmon] 1 attention layer(s) monitored without folding their QK-norm"
    assert [warning in r.output for r in results] == [True, False], results[0].output[-3000:]  # rank 0 only
    assert "layers.3.self_attn.q_norm (HeadScale)" in results[0].output
    weights = torch.load(tmp_path / "weights.pt")
    rows = [json.loads(line) for line in (tmp_path / "mon" / "mechmon_scalars.jsonl").read_text().splitlines()]
    checked = 0
    for row in rows:
        step = row["step"]
        for layer, kind in enumerate(ENGINE_KINDS, start=1):
            keys = [f"mechmon/attn/delta2_entropy/layer_{layer}/head_{h}" for h in range(HEADS)]
            if keys[0] not in row["scalars"]:
                continue
            got = torch.tensor([row["scalars"][k] for k in keys], dtype=torch.float64)
            assert not torch.equal(weights[step][layer - 1]["q_norm"], weights[step - 2][layer - 1]["q_norm"])
            folded = dense_delta2_entropy(*_rows_at(weights, step - 2, layer - 1, kind, True),
                                           *_rows_at(weights, step, layer - 1, kind, True), alpha=ALPHA)
            unfolded = dense_delta2_entropy(*_rows_at(weights, step - 2, layer - 1, kind, False),
                                             *_rows_at(weights, step, layer - 1, kind, False), alpha=ALPHA)
            # The unknown norm's layer is monitored on the projection rows themselves.
            torch.testing.assert_close(got, unfolded if kind == "unknown" else folded, rtol=1e-5, atol=0)
            assert (folded - unfolded).abs().max() > 1e-3, (kind, step)  # the fold matters
            checked += 1
    assert checked >= 3 * len(ENGINE_KINDS), rows
