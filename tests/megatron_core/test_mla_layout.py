"""The layout facts the MLA kernel (``monitors/mla_increment.py``) relies on, checked against the
installed megatron-core's own ``MLASelfAttention`` (0.16.1 on the fast leg, 0.19 on the current
leg): for one token at position 0 (where RoPE is the identity), the module's query and key of
every head equal the effective projections ``A_h x`` and ``B_h x`` of docs/METHOD.md section 4b,
with each latent RMSNorm's gamma folded in and its input-dependent ``1/rms`` applied: per head
``d_nope`` no-RoPE rows then ``d_rope`` RoPE rows of ``linear_q_up_proj`` (or ``linear_q_proj``),
``linear_kv_down_proj`` rows ``[:kv_lora_rank]`` the latent and ``[kv_lora_rank:]`` the RoPE key
shared by every head, ``linear_kv_up_proj`` per head ``d_nope`` key rows then ``d_v`` value rows.
Then the kernel, fed the module's own weights before and after an optimizer step, matches the
dense float64 reference built from those projections.

Only the projections are built: the module's core attention (unused by
``get_query_key_value_tensors``) is a stand-in, since megatron-core's local ``DotProductAttention``
refuses MLA's separate key and value head sizes; without Transformer Engine, megatron-core 0.16.1's
``MLASelfAttention`` compares against a ``TELinear`` that is not a class, which the test replaces.
"""

from __future__ import annotations

import pytest
import torch

from mechmon_megatron.monitors import MLAWeights, mla_delta2_singular_values
from tests.monitors.test_mla_increment import assert_spectra_close, dense_singular_values, effective_projections

pytest.importorskip("megatron.core")

HIDDEN, HEADS, R_Q, R_KV, D_NOPE, D_ROPE, D_V = 64, 4, 24, 16, 8, 4, 8
EPS = 1e-5


class _UnusedCoreAttention(torch.nn.Module):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


def _mla_module(q_lora_rank):
    """The layer with latent norms when it has a query latent; without one, with none (megatron-core
    0.19 fuses a query norm into ``linear_q_proj``, which needs Transformer Engine)."""
    norms = q_lora_rank is not None
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if not isinstance(getattr(mla, "TELinear", None), type):
        mla.TELinear = type("NoTransformerEngineLinear", (), {})
    config = MLATransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=R_KV,
        qk_head_dim=D_NOPE, qk_pos_emb_head_dim=D_ROPE, v_head_dim=D_V, rope_type="rope", layernorm_epsilon=EPS,
        normalization="RMSNorm", qk_layernorm=norms, use_cpu_initialization=True, params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=norms).submodules.self_attention
    spec.submodules.core_attention = _UnusedCoreAttention
    module = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():  # gammas away from 1, so that folding them is checked
        for name, param in module.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(torch.rand_like(param) + 0.5)
    return module


def _weights(module) -> MLAWeights:
    get = {name: p.detach().clone() for name, p in module.named_parameters()}
    common = dict(kv_down=get["linear_kv_down_proj.weight"], kv_up=get["linear_kv_up_proj.weight"],
                  kv_norm=get.get("kv_layernorm.weight"))
    if "linear_q_proj.weight" in get:
        return MLAWeights(q_proj=get["linear_q_proj.weight"], **common)
    return MLAWeights(q_down=get["linear_q_down_proj.weight"], q_norm=get["q_layernorm.weight"],
                      q_up=get["linear_q_up_proj.weight"], **common)


def _rms(v: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(v.pow(2).mean() + EPS)


@pytest.mark.parametrize("q_lora_rank", [R_Q, None])
def test_module_query_and_key_are_the_effective_projections(model_parallel, q_lora_rank):
    module = _mla_module(q_lora_rank)
    w = _weights(module)
    x = torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        query, key = module.get_query_key_value_tensors(x, None)[:2]
    query, key = query.double().reshape(HEADS, D_NOPE + D_ROPE), key.double().reshape(HEADS, D_NOPE + D_ROPE)
    a, b = effective_projections(w, D_NOPE, D_ROPE, HEADS)
    xv = x.double().reshape(HIDDEN)
    q_scale = 1.0 if w.q_proj is not None else 1.0 / _rms(w.q_down.double() @ xv)
    kv_scale = 1.0 if w.kv_norm is None else 1.0 / _rms(w.kv_down.double()[:R_KV] @ xv)
    q_ref, k_ref = (a @ xv) * q_scale, torch.cat([(b[:, :D_NOPE] @ xv) * kv_scale, b[:, D_NOPE:] @ xv], dim=1)
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(query[:, :D_NOPE], q_ref[:, :D_NOPE], **close)
    torch.testing.assert_close(key[:, :D_NOPE], k_ref[:, :D_NOPE], **close)
    # The RoPE part: megatron-core reorders the RoPE channels of q and k alike before rotating them
    # (interleaved pairs), so the vectors agree up to one permutation and the logit, the bilinear
    # form Delta2 is about, agrees exactly (k_pe has no norm).
    torch.testing.assert_close(query[:, D_NOPE:].sort(dim=1).values, q_ref[:, D_NOPE:].sort(dim=1).values, **close)
    torch.testing.assert_close(key[:, D_NOPE:].sort(dim=1).values, k_ref[:, D_NOPE:].sort(dim=1).values, **close)
    torch.testing.assert_close((query * key).sum(dim=1), (q_ref * k_ref).sum(dim=1), **close)
    assert torch.equal(key[0, D_NOPE:], key[-1, D_NOPE:])  # one RoPE key, shared by every head


@pytest.mark.parametrize("q_lora_rank", [R_Q, None])
def test_kernel_on_the_modules_weights_across_an_optimizer_step(model_parallel, q_lora_rank):
    module = _mla_module(q_lora_rank)
    prev = _weights(module)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    query, key, _ = module.get_query_key_value_tensors(torch.randn(3, 2, HIDDEN), None)[:3]
    (query.pow(2).sum() + (query * key).sum()).backward()
    optimizer.step()
    now = _weights(module)
    assert prev.kv_norm is None or not torch.equal(prev.kv_norm, now.kv_norm)  # the gammas moved too
    got = mla_delta2_singular_values(prev, now, d_nope=D_NOPE, d_rope=D_ROPE, num_heads=HEADS, head_chunk=3)
    ref = dense_singular_values(prev, now, D_NOPE, D_ROPE, HEADS)
    for stream in ("content", "whole"):
        assert_spectra_close(got[stream], ref[stream], what=stream)
