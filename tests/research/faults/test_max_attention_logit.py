"""megatron-core's max attention logit (``--log-max-attention-logit``) with our core attention.

Our attention keeps ``current_max_attn_logits`` as Transformer Engine's does with
``return_max_logit``; megatron-core's own ``clip_qk(model, log_max_only=True)`` reads it (the
value Megatron-LM logs as ``max_attention_logit``). Checked against dense ``Q K^T`` on a real
megatron-core GPTModel.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer.qk_clip import clip_qk  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mechmon_megatron.research.faults.attention_backends import build_core_attention_spec  # noqa: E402
from mechmon_megatron.research.faults.emulated_fa import EmulatedFAConfig  # noqa: E402

HEADS, GROUPS, HIDDEN, SEQ, BATCH = 4, 2, 32, 12, 3


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
        log_max_attention_logit=True, **kw,
    )


def dense_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-head max of q_i . k_j * scale over j <= i: q [s,b,np,hn], k [s,b,ng,hn] -> [np]."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("ibhd,jbhd->bhij", q.double(), k.double()) * scale
    future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("backend", ["torch", "emulated-lowp-fa"])
def test_running_per_head_max_matches_dense_scores(model_parallel, backend):
    config = _config()
    attention = build_module(
        build_core_attention_spec(backend, emulation=EmulatedFAConfig(block_q=4, block_k=4, emulate_bf16=False)),
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        cp_comm_type=None, softmax_scale=None,
    )
    assert attention.current_max_attn_logits is None
    hn = config.kv_channels
    expected = None
    for seed in (0, 1):  # two forwards: the running maximum, as TE keeps it between clip_qk calls
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(SEQ, BATCH, HEADS, hn, generator=gen) * (1 + 3 * seed)
        k, v = (torch.randn(SEQ, BATCH, GROUPS, hn, generator=gen) for _ in range(2))
        attention(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        step = dense_max_logits(q, k, attention.softmax_scale)
        expected = step if expected is None else torch.maximum(expected, step)
        assert attention.current_max_attn_logits.shape == (HEADS,)
        torch.testing.assert_close(attention.current_max_attn_logits.double(), expected, rtol=1e-6, atol=1e-6)


def test_not_recorded_unless_asked(model_parallel):
    config = _config()
    config.log_max_attention_logit = False
    attention = build_module(build_core_attention_spec("torch"), config=config, layer_number=1,
                             attn_mask_type=AttnMaskType.causal, attention_type="self")
    q = torch.randn(SEQ, BATCH, HEADS, config.kv_channels)
    attention(q, q[:, :, :GROUPS], q[:, :, :GROUPS], None, attn_mask_type=AttnMaskType.causal)
    assert attention.current_max_attn_logits is None


def test_refusals_name_the_flag(model_parallel):
    with pytest.raises(ValueError, match="--qk-clip"):
        build_module(build_core_attention_spec("torch"), config=_config(qk_clip=True), layer_number=1,
                     attn_mask_type=AttnMaskType.causal, attention_type="self")


def _gpt_model(config: TransformerConfig) -> GPTModel:
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = build_core_attention_spec("torch")
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def _forward_with_dense_reference(model: GPTModel, seed: int, qkv_scale: float = 1.0) -> float:
    """One forward; returns the max over layers and heads of the dense logits it formed."""
    seen: list[torch.Tensor] = []
    hooks = [layer.self_attention.core_attention.register_forward_pre_hook(
        lambda module, args: seen.append(dense_max_logits(args[0], args[1], module.softmax_scale)))
        for layer in model.decoder.layers]
    tokens = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for layer in model.decoder.layers:  # q and k scale with W_qkv, logits with its square
            layer.self_attention.linear_qkv.weight.mul_(qkv_scale)
        model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    for hook in hooks:
        hook.remove()
    assert len(seen) == len(model.decoder.layers)
    return float(torch.stack(seen).max())


def test_megatron_clip_qk_reads_our_layers(model_parallel):
    """megatron-core's clip_qk on a 2-layer GPTModel with our attention returns the max over layers
    and heads of the dense logits of the forward."""
    model = _gpt_model(_config())
    expected = _forward_with_dense_reference(model, seed=3)
    # clip_qk walks chunk.module.module.decoder (Megatron-LM's DDP(Float16Module(GPTModel)) nesting)
    assert clip_qk([SimpleNamespace(module=SimpleNamespace(module=model))], log_max_only=True) == pytest.approx(
        expected, rel=1e-6)


def test_trainer_reports_each_steps_max_logit(model_parallel):
    """The example trainer's metric is megatron's clip_qk value of that step alone (the running
    maxima are reset after each read, as megatron-core 0.19 does, also on 0.16)."""
    from gpt_trainer.attention import AttentionStepCallback

    model = _gpt_model(_config())
    callback = AttentionStepCallback(SimpleNamespace(log_max_attention_logit=True))
    callback.on_train_start(SimpleNamespace(model_chunks=[SimpleNamespace(module=model)]))  # DDP-like chunk
    first = _forward_with_dense_reference(model, seed=3)
    assert callback.step_metrics()["max_attn_logit"] == pytest.approx(first, rel=1e-6)
    second = _forward_with_dense_reference(model, seed=3, qkv_scale=0.5)  # a quarter of the logits
    assert second < first / 2  # exactly a quarter in layer 1; layer 2 also sees a changed input
    assert callback.step_metrics()["max_attn_logit"] == pytest.approx(second, rel=1e-6)
    assert AttentionStepCallback(SimpleNamespace(log_max_attention_logit=False)).step_metrics() == {}
