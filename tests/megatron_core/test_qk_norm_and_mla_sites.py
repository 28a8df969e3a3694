"""The megatron-core adapter on QK-norm and multi-head latent attention (MLA) layers, with the
installed megatron-core's own modules (0.16.1 on the fast leg, 0.19 on the current leg).

* QK-norm (``qk_layernorm``): the site hands the check each head's gamma; the folded rows
  ``diag(gamma) W`` reproduce the module's own normalised query and key (times the input's RMS),
  and the check's Delta2 entropy equals a dense float64 reference on the folded rows across a real
  optimizer step -- and differs from the entropy of the unfolded rows (the fold matters).
* MLA: discovery finds ``MLASelfAttention`` (with and without ``q_lora_rank``); the site's read
  is the kernel's input, and the check's content entropy per head equals the dense reference.
* Left out, with the reason, never a crash: an absorbed MLA layer (``linear_kv_up_proj`` removed,
  as ``cache_mla_latents`` does) and cross-attention.
"""

from __future__ import annotations

import logging

import pytest
import torch

from mechmon_megatron.monitors.spectral import spectral_stats
from tests.monitors.dense_reference import dense_delta2_entropy
from tests.monitors.test_mla_increment import dense_singular_values

pytest.importorskip("megatron.core")

from mechmon_megatron.adapters.megatron_core.discovery import find_left_out, find_modules  # noqa: E402
from mechmon_megatron.adapters.megatron_core.sites import attention_sites  # noqa: E402
from mechmon_megatron.session.attention_check import check_heads  # noqa: E402
from mechmon_megatron.session.collective_guard import guard  # noqa: E402
from mechmon_megatron.session.host import MLAHeads, QKWeights  # noqa: E402
from mechmon_megatron.session.mla_check import check_mla_heads  # noqa: E402
from mechmon_megatron.session.snapshots import SnapshotStore  # noqa: E402
from mechmon_megatron.session.startup import log_left_out  # noqa: E402
from tests.megatron_core.test_mla_layout import D_NOPE, D_ROPE, HEADS, R_Q, _mla_module  # noqa: E402
from tests.megatron_core.test_mla_layout import HIDDEN as MLA_HIDDEN  # noqa: E402

HIDDEN, NUM_HEADS, GROUPS, HEAD_DIM = 32, 4, 2, 8
EPS = 1e-5


class _Holder(torch.nn.Module):
    """A model chunk holding one attention module (discovery walks ``named_modules``)."""

    def __init__(self, attention: torch.nn.Module) -> None:
        super().__init__()
        self.attention = attention


def _qk_norm_attention(normalization: str = "RMSNorm"):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=NUM_HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, qk_layernorm=True,
                               normalization=normalization, layernorm_epsilon=EPS, use_cpu_initialization=True,
                               params_dtype=torch.float32, add_bias_linear=False)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization=normalization).submodules.self_attention
    module = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():  # gammas away from 1, so that folding them is checked
        module.q_layernorm.weight.copy_(torch.rand(HEAD_DIM) + 0.5)
        module.k_layernorm.weight.copy_(torch.rand(HEAD_DIM) + 0.5)
    return module


def _site(module):
    found, _ = find_modules([_Holder(module)])
    assert len(found) == 1
    left: list = []
    sites = attention_sites(found, None, full_matrix=True, left_out=left, guard=guard())
    return sites, left, found[0]


def _read(site):
    full = site.read_full()
    return site.read_heads(), full


def _train_step(module, forward) -> None:
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    forward().backward()
    optimizer.step()


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_qk_norm_site_folds_gamma_and_matches_the_modules_query_and_key(model_parallel, normalization):
    module = _qk_norm_attention(normalization)
    sites, left, _ = _site(module)
    assert not left
    heads, _ = _read(sites[0])
    assert isinstance(heads, QKWeights) and heads.q_norm is not None and heads.k_norm is not None
    assert heads.q_norm.centres == (normalization == "LayerNorm")
    x = torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        query, key = module.get_query_key_value_tensors(x)[:2]
    from mechmon_megatron.monitors.norm_fold import fold_norm

    xv = x.double().reshape(HIDDEN)
    for got, rows, norm in ((query, heads.wq, heads.q_norm), (key, heads.wk, heads.k_norm)):
        raw = rows.double() @ xv  # [heads, head_dim]
        centred = raw - raw.mean(dim=1, keepdim=True) if norm.centres else raw
        scale = torch.sqrt(centred.pow(2).mean(dim=1, keepdim=True) + EPS)
        folded = fold_norm(rows, norm) @ xv
        torch.testing.assert_close(got.double().reshape(folded.shape) * scale, folded, rtol=1e-5, atol=1e-6)


def test_qk_norm_check_equals_dense_reference_on_folded_rows(model_parallel):
    module = _qk_norm_attention()
    sites, _, _ = _site(module)
    store = SnapshotStore("cpu")
    prev, _ = store.take(*_read(sites[0]))
    x = torch.randn(6, 2, HIDDEN)
    _train_step(module, lambda: sum(t.pow(2).sum() for t in module.get_query_key_value_tensors(x)[:2]))
    now, _ = _read(sites[0])
    assert not torch.equal(prev.q_norm.gamma, now.q_norm.gamma)  # the gammas moved too
    out = check_heads(1, prev, now, alpha=1.0, method="compressed", per_head_scalars=True)
    got = torch.tensor([s.value for s in out.streams], dtype=torch.float64)
    from mechmon_megatron.monitors.norm_fold import fold_norm

    ref = dense_delta2_entropy(fold_norm(prev.wq, prev.q_norm), fold_norm(prev.wk, prev.k_norm),
                                fold_norm(now.wq, now.q_norm), fold_norm(now.wk, now.k_norm), alpha=1.0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    unfolded = dense_delta2_entropy(prev.wq, prev.wk, now.wq, now.wk, alpha=1.0)
    assert (got - unfolded).abs().max() > 1e-3  # without the gammas the monitor reads another matrix


@pytest.mark.parametrize("q_lora_rank", [R_Q, None])
def test_mla_site_and_check_equal_dense_reference(model_parallel, q_lora_rank):
    module = _mla_module(q_lora_rank)
    sites, left, found = _site(module)
    assert found.kind == "mla" and not left
    store = SnapshotStore("cpu")
    prev, prev_full = store.take(*_read(sites[0]))
    assert isinstance(prev, MLAHeads) and prev.num_heads == HEADS and prev.weights.kv_up.shape[0] == HEADS * D_NOPE
    if q_lora_rank is not None:  # the down projection is one copy, shared by both reads
        assert prev_full.wq.data_ptr() == prev.weights.q_down.data_ptr()
    x = torch.randn(3, 2, MLA_HIDDEN)
    _train_step(module, lambda: sum(t.pow(2).sum() for t in module.get_query_key_value_tensors(x, None)[:2]))
    now, now_full = _read(sites[0])
    out = check_mla_heads(1, prev, now, alpha=1.0, per_head_scalars=True, head_chunk=3)
    ref = dense_singular_values(prev.weights, now.weights, D_NOPE, D_ROPE, HEADS)
    for stream, metric in (("content", "delta2_entropy"), ("whole", "delta2_whole_entropy")):
        expected = spectral_stats(ref[stream], alpha=1.0)["entropy"]
        got = torch.tensor([out.scalars[f"mechmon/attn/{metric}/layer_1/head_{h}"].value for h in range(HEADS)],
                           dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    assert [s.member for s in out.streams] == [f"head_{h}" for h in range(HEADS)]
    assert {s.family for s in out.streams} == {"attn_delta2"}
    expected_q = module.linear_q_down_proj.weight if q_lora_rank is not None else module.linear_q_proj.weight
    assert torch.equal(now_full.wq, expected_q.detach()) and torch.equal(now_full.wk,
                                                                        module.linear_kv_down_proj.weight.detach())


def test_absorbed_mla_is_left_out_with_its_reason(model_parallel, caplog):
    module = _mla_module(R_Q)
    del module.linear_kv_up_proj  # what cache_mla_latents does for inference
    sites, left, _ = _site(module)
    assert sites == [] and len(left) == 1 and "absorbed MLA" in left[0].reason
    with caplog.at_level(logging.WARNING):
        log_left_out(left)
    assert "attention monitors leave out 1 layer(s): layer 1: absorbed MLA" in caplog.text


def test_mla_shape_that_does_not_reconcile_is_left_out(model_parallel):
    module = _mla_module(R_Q)
    module.config.kv_lora_rank += 1  # the config no longer matches the weights
    sites, left, _ = _site(module)
    assert sites == [] and "linear_kv_down_proj has" in left[0].reason


def test_cross_attention_is_named_as_left_out(model_parallel):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=NUM_HEADS,
                               use_cpu_initialization=True, add_bias_linear=False)
    subs = CrossAttentionSubmodules(linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                                    core_attention=DotProductAttention, linear_proj=RowParallelLinear)
    try:
        module = CrossAttention(config, subs, layer_number=1, attn_mask_type=AttnMaskType.padding)
    except Exception as exc:  # noqa: BLE001 -- a release whose CrossAttention needs more (skip, say why)
        pytest.skip(f"megatron-core's CrossAttention does not build on CPU here: {exc}")
    found, _ = find_modules([_Holder(module)])
    assert found == []
    left = find_left_out([_Holder(module)])
    assert [(item.layer_number, item.reason.split(" ")[0]) for item in left] == [(1, "cross-attention")]


def test_hybrid_stack_names_mamba_and_gated_deltanet_once(model_parallel, caplog):
    """megatron-core's ``MambaMixer`` needs mamba_ssm and ``GatedDeltaNet`` flash-linear-attention,
    both CUDA-only: here stand-ins carry their class names and ``layer_number`` (all discovery
    looks at), next to a real QK-norm ``SelfAttention``."""
    stand_ins = [type(name, (torch.nn.Module,), {})() for name in ("MambaMixer", "GatedDeltaNet")]
    for layer, module in zip((2, 3), stand_ins):
        module.layer_number = layer
    chunk = torch.nn.ModuleList([_qk_norm_attention(), *stand_ins])
    found, _ = find_modules([chunk])
    assert [item.layer_number for item in found] == [1]
    left = find_left_out([chunk])
    assert [(item.layer_number, item.reason.split(" ")[0]) for item in left] == [(2, "Mamba"), (3, "gated")]
    with caplog.at_level(logging.WARNING):
        log_left_out(left)
    line = next(r.getMessage() for r in caplog.records if "leave out" in r.getMessage())
    assert "layer 2: Mamba SSM mixer" in line and "layer 3: gated DeltaNet" in line
