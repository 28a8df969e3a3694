"""Core attention with query/key head dim ``d_qk`` != value head dim ``d_v`` (multi-head latent
attention): the emulated FA kernel and the megatron-core backends against a dense float64 softmax
attention, the FA fault's structure with ``d_v`` wide O, and megatron-core's own
``MLASelfAttention`` built around the backends.
"""

from __future__ import annotations

import math

import pytest
import torch

from mechmon_megatron.research.faults.emulated_fa import EmulatedFAConfig, emulated_flash_attention, ulp_bf16
from mechmon_megatron.research.faults.fault_config import FaultConfig

D_QK, D_V = 12, 8  # e.g. qk_head_dim 8 + qk_pos_emb_head_dim 4, v_head_dim 8
EXACT = EmulatedFAConfig(block_q=7, block_k=5, emulate_bf16=False)  # tiles that do not divide N


def _qkv(b=2, h=3, n=19, d=D_QK, e=D_V, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
    v = torch.randn(b, h, n, e, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def _probs(q, k, scale, causal):
    """``softmax(q k^T * scale)`` in float64: q [B,H,N,D], k [B,H,M,D] -> [B,H,N,M]."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores, dim=-1)


def _dense(q, k, v, scale, causal):
    """Dense softmax attention in float64: q, k [B,H,N,D], v [B,H,N,E] -> [B,H,N,E]."""
    return _probs(q, k, scale, causal) @ v.double()


def _grads(out, inputs, d_out):
    return torch.autograd.grad(out, inputs, d_out)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_exact_kernel_equals_dense_float64_attention(causal, scale):
    q, k, v = _qkv()
    out = emulated_flash_attention(q, k, v, softmax_scale=scale, causal=causal, config=EXACT)
    ref = _dense(q, k, v, scale if scale is not None else 1.0 / math.sqrt(D_QK), causal)
    assert out.shape == (2, 3, 19, D_V)
    d_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for got, want in zip(_grads(out, (q, k, v), d_out), _grads(ref, (q, k, v), d_out)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_bf16_emulation_stays_within_bf16_tolerance():
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(n=40))
    out = emulated_flash_attention(q, k, v)
    ref = _dense(q, k, v, 1.0 / math.sqrt(D_QK), True)
    assert out.dtype == torch.float32 and out.shape[-1] == D_V
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_value_head_dim_may_be_wider_than_query_key():
    q, k, v = _qkv(d=4, e=10)
    out = emulated_flash_attention(q, k, v, config=EXACT)
    torch.testing.assert_close(out, _dense(q, k, v, 0.5, True), atol=1e-12, rtol=1e-12)


def test_shape_validation_names_the_layout():
    q, k, v = _qkv(n=8)
    with pytest.raises(ValueError, match=r"v \[B,H,M,E\]"):
        emulated_flash_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="q and k head dims differ"):
        emulated_flash_attention(q, k[..., :5], v)


def test_fault_acts_through_delta_on_the_value_wide_output():
    """With d_v != d_qk the fault changes dQ and dK by the predicted rank-one-per-row terms (delta is
    a row sum over the d_v wide O) and leaves O and dV untouched."""
    q, k, v = _qkv(dtype=torch.float32)
    scale = 1.0 / math.sqrt(D_QK)
    d_out = torch.randn(2, 3, 19, D_V, generator=torch.Generator().manual_seed(11))
    out0 = emulated_flash_attention(q, k, v, config=EXACT)
    dq0, dk0, dv0 = _grads(out0, (q, k, v), d_out)
    fault = FaultConfig(strength=8.0)
    out1 = emulated_flash_attention(q, k, v, config=EXACT, fault=fault)
    dq1, dk1, dv1 = _grads(out1, (q, k, v), d_out)
    assert torch.equal(out0, out1) and torch.equal(dv0, dv1)
    with torch.no_grad():
        e = (d_out * fault.strength * ulp_bf16(out0) * torch.sign(out0)).sum(-1, keepdim=True)
        p = _probs(q, k, scale, True).float()
        want_dq = -scale * e * (p @ k)
        want_dk = -scale * (p * e).transpose(-1, -2) @ q
    torch.testing.assert_close(dq1 - dq0, want_dq, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(dk1 - dk0, want_dk, atol=1e-6, rtol=1e-4)
    assert want_dq.abs().max() > 0


# ---------------------------------------------------------------------------------------------
# megatron-core backends (MechmonCoreAttention) with k_channels / v_channels


def _config(heads=4, groups=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                             use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)


def _core(backend, config, softmax_scale=None, emulation=None):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from mechmon_megatron.research.faults.attention_backends import build_core_attention_spec

    return build_module(build_core_attention_spec(backend, emulation=emulation), config=config, layer_number=1,
                        attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=softmax_scale,
                        k_channels=D_QK, v_channels=D_V)


@pytest.mark.parametrize("backend,emulation", [("torch", None), ("emulated-lowp-fa", EXACT)])
@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("softmax_scale", [None, 0.2])
def test_backends_take_separate_key_and_value_head_dims(model_parallel, backend, emulation, groups, softmax_scale):
    """Queries [sq,b,np,d_qk], keys [sk,b,ng,d_qk], values [sk,b,ng,d_v] -> [sq,b,np*d_v], equal to the
    dense float64 reference (GQA groups repeated), with the given scale or 1/sqrt(d_qk)."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import AttnMaskType

    module = _core(backend, _config(groups=groups), softmax_scale, emulation)
    assert (module.k_channels, module.v_channels) == (D_QK, D_V)
    gen = torch.Generator().manual_seed(3)
    s, b = 16, 2
    q = torch.randn(s, b, 4, D_QK, generator=gen).requires_grad_()
    k = torch.randn(s, b, groups, D_QK, generator=gen).requires_grad_()
    v = torch.randn(s, b, groups, D_V, generator=gen).requires_grad_()
    out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (s, b, 4 * D_V)
    rep = 4 // groups
    ref = _dense(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3).repeat_interleave(rep, 1),
                 v.permute(1, 2, 0, 3).repeat_interleave(rep, 1),
                 softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D_QK), True)
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, 4 * D_V)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    d_out = torch.randn(out.shape, generator=gen)
    for got, want in zip(_grads(out, (q, k, v), d_out), _grads(ref, (q, k, v), d_out.double())):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gpu_backends_refuse_unequal_head_dims():
    pytest.importorskip("megatron.core")
    from mechmon_megatron.research.faults.attention_backends import _check_head_dims

    for backend in ("flash-attn", "fp8"):
        with pytest.raises(ValueError, match="needs equal query/key and value head dims"):
            _check_head_dims(backend, D_QK, D_V)
        _check_head_dims(backend, D_V, D_V)
    _check_head_dims("torch", D_QK, D_V)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_megatron_mla_layer_around_the_backends(model_parallel, q_lora_rank):
    """megatron-core's MLASelfAttention (local spec) builds with our core attention, passes its
    softmax scale 1/sqrt(d_qk) (plain RoPE: no YaRN mscale) and the head dims, and the exact
    emulated kernel equals torch's SDPA on the same weights."""
    pytest.importorskip("megatron.core")
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from mechmon_megatron.research.faults.attention_backends import build_core_attention_spec

    # megatron-core 0.16 without Transformer Engine: TELinear is a mock, which isinstance refuses
    # (the example trainer's patch_mla_without_transformer_engine says more).
    if mla.TELinear is not None and not isinstance(mla.TELinear, type):
        mla.TELinear = type("NoTransformerEngineLinear", (), {})
    norms = q_lora_rank is not None
    config = MLATransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=D_V, rope_type="rope", normalization="RMSNorm",
        qk_layernorm=norms, use_cpu_initialization=True, add_bias_linear=False, apply_rope_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0)
    outputs = []
    for backend, emulation in (("torch", None), ("emulated-lowp-fa", EXACT)):
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=norms, normalization="RMSNorm")
        spec = spec.submodules.self_attention
        spec.submodules.core_attention = build_core_attention_spec(backend, emulation=emulation)
        torch.manual_seed(0)
        module = build_module(spec, config=config, layer_number=1)
        core = module.core_attention
        assert (core.k_channels, core.v_channels) == (D_QK, D_V)
        assert core.softmax_scale == pytest.approx(1.0 / math.sqrt(D_QK), rel=1e-12)
        hidden = torch.randn(10, 2, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out, _ = module(hidden, attention_mask=None)
        out.sum().backward()
        outputs.append((out.detach(), hidden.grad))
    assert outputs[0][0].shape == (10, 2, 32)
    for got, want in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
