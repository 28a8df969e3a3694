"""Tests of the megatron-core core-attention backends against megatron's own DotProductAttention.

Runs on CPU with a one-process gloo group. megatron's DotProductAttention allocates its score
buffer with ``torch.cuda.current_device()`` and forks the CUDA RNG tracker for dropout; both are
replaced with CPU stand-ins for the duration of each test only (``monkeypatch``).
"""

import contextlib
import copy
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mechmon_megatron.research.faults.attention_backends import (  # noqa: E402
    MechmonCoreAttention,
    backend_unavailable_reason,
    build_core_attention_spec,
)
from mechmon_megatron.research.faults.emulated_fa import EmulatedFAConfig  # noqa: E402
from mechmon_megatron.research.faults.fault_config import FaultConfig  # noqa: E402

EXACT = EmulatedFAConfig(block_q=8, block_k=8, emulate_bf16=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_parallel():
    """A one-process gloo group with megatron's model-parallel state (world size 1)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


class _CpuBuffer:
    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


class _NoRngTracker:
    def fork(self, name="model-parallel-rng"):
        return contextlib.nullcontext()


@pytest.fixture
def cpu_megatron(model_parallel, monkeypatch):
    """Let megatron's DotProductAttention run on CPU (this test only)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: _CpuBuffer())
        monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: _NoRngTracker())


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


class _FakePgCollection:
    """Stands in for a ProcessGroupCollection of a tensor-parallel rank (only ``tp.size()``)."""

    def __init__(self, tp_size):
        self.tp = _Group(tp_size)


def _config(heads=4, groups=None, hidden=32, **kw):
    return TransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, **kw,
    )


def _inputs(sq, b, heads, groups, hn, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, hn, generator=gen).requires_grad_()
    k = torch.randn(sq, b, groups, hn, generator=gen).requires_grad_()
    v = torch.randn(sq, b, groups, hn, generator=gen).requires_grad_()
    return q, k, v


def _causal_mask(s):
    return torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]


def _run(module, q, k, v, mask, d_out=None):
    out = module(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
    if d_out is None:
        d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out, grads, d_out


def _build(spec_or_cls, config, pg_collection=None, layer_number=1, **params):
    return build_module(
        spec_or_cls, config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
        attention_type="self", cp_comm_type=None, softmax_scale=None, pg_collection=pg_collection,
        **params,
    )


@pytest.mark.parametrize("backend,emulation", [("torch", None), ("emulated-lowp-fa", EXACT)])
@pytest.mark.parametrize("heads,groups,tp", [(4, 4, 1), (4, 2, 1), (4, 1, 1), (4, 2, 2), (8, 4, 2)])
def test_matches_megatron_dot_product_attention(cpu_megatron, backend, emulation, heads, groups, tp):
    """Same output and input gradients as DotProductAttention, incl. GQA and TP-local heads."""
    config = _config(heads=heads, groups=groups)
    pg = _FakePgCollection(tp) if tp > 1 else None
    reference = _build(DotProductAttention, config, pg)
    ours = _build(build_core_attention_spec(backend, emulation=emulation), config, pg)
    assert isinstance(ours, MechmonCoreAttention)
    assert ours.num_attention_heads_per_partition == heads // tp
    s, b, hn = 16, 2, config.kv_channels
    q, k, v = _inputs(s, b, heads // tp, groups // tp, hn)
    ref_out, ref_grads, d_out = _run(reference, q, k, v, _causal_mask(s))
    for mask in (_causal_mask(s), None):
        out, grads, _ = _run(ours, q, k, v, mask, d_out)
        assert out.shape == (s, b, heads // tp * hn)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_emulated_bf16_is_close_to_megatron(cpu_megatron):
    config = _config(heads=4, groups=2)
    reference = _build(DotProductAttention, config)
    ours = _build(build_core_attention_spec("emulated-lowp-fa"), config)
    q, k, v = _inputs(32, 2, 4, 2, config.kv_channels)
    ref_out, _, _ = _run(reference, q, k, v, _causal_mask(32))
    out, _, _ = _run(ours, q, k, v, None)
    assert ((out - ref_out).abs().max() / ref_out.abs().max()).item() < 1e-2
    assert not torch.equal(out, ref_out)


def test_fault_reaches_layers_through_the_shared_step_counter(model_parallel):
    config = _config(heads=4, groups=2)
    fault = FaultConfig(strength=32.0, onset_step=5, layer_numbers=(2,))
    spec = build_core_attention_spec("emulated-lowp-fa", fault)
    layer1 = _build(spec, config, layer_number=1)
    layer2 = _build(spec, config, layer_number=2)
    assert layer1.fault is None and layer2.fault is fault
    q, k, v = _inputs(16, 2, 4, 2, config.kv_channels)
    clean = _build(build_core_attention_spec("emulated-lowp-fa"), config, layer_number=2)
    out0, grads0, d_out = _run(clean, q, k, v, None)
    fault.set_step(4)
    _, before, _ = _run(layer2, q, k, v, None, d_out)
    assert all(torch.equal(a, b) for a, b in zip(before, grads0))
    fault.set_step(5)
    out1, after, _ = _run(layer2, q, k, v, None, d_out)
    assert torch.equal(out0, out1)
    assert not torch.equal(after[0], grads0[0])
    _, untargeted, _ = _run(layer1, q, k, v, None, d_out)
    assert all(torch.equal(a, b) for a, b in zip(untargeted, grads0))


def test_spec_plugs_into_a_gpt_layer(model_parallel):
    """The spec works in the core_attention slot of megatron's local GPT layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer_spec = copy.deepcopy(get_gpt_layer_local_spec())
    fault = FaultConfig(strength=8.0)
    layer_spec.submodules.self_attention.submodules.core_attention = build_core_attention_spec(
        "emulated-lowp-fa", fault
    )
    config = _config(heads=4, groups=2)
    layer = build_module(layer_spec, config=config, layer_number=1)
    assert isinstance(layer.self_attention.core_attention, MechmonCoreAttention)
    assert layer.self_attention.core_attention.fault is fault
    hidden = torch.randn(16, 2, config.hidden_size, requires_grad=True)
    out, _ = layer(hidden, attention_mask=None)
    out.sum().backward()
    assert out.shape == hidden.shape and hidden.grad is not None


def test_unknown_backend_and_misuse_raise_value_error(model_parallel):
    with pytest.raises(ValueError, match="Unknown attention backend 'tf32'"):
        build_core_attention_spec("tf32")
    with pytest.raises(ValueError, match="use backend 'emulated-lowp-fa'"):
        build_core_attention_spec("torch", FaultConfig(strength=8.0))
    assert isinstance(build_core_attention_spec("torch", FaultConfig()), ModuleSpec)  # disabled fault
    config = _config()
    config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="--attention-dropout 0"):
        _build(build_core_attention_spec("emulated-lowp-fa"), config)
    assert _build(build_core_attention_spec("torch"), config).dropout_p == 0.1


def test_unsupported_masks_raise(model_parallel):
    ours = _build(build_core_attention_spec("torch"), _config())
    q, k, v = _inputs(8, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="causal and no_mask only"):
        ours(q, k, v, None, attn_mask_type=AttnMaskType.padding)
    reset = _causal_mask(8).clone()
    reset[..., 5, 1] = True  # a document boundary
    with pytest.raises(ValueError, match="only supports the plain causal mask"):
        ours(q, k, v, reset, attn_mask_type=AttnMaskType.causal)
    out = ours(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)))
    torch.testing.assert_close(out, ref.permute(2, 0, 1, 3).reshape(8, 1, 32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error messages")
@pytest.mark.parametrize("backend", ["flash-attn", "fp8"])
def test_gpu_backends_name_what_is_missing_on_cpu(model_parallel, backend):
    assert "needs a CUDA GPU" in backend_unavailable_reason(backend)
    with pytest.raises(RuntimeError, match=f"attention backend '{backend}' needs a CUDA GPU"):
        build_core_attention_spec(backend)
    spec = ModuleSpec(module=MechmonCoreAttention, params={"backend": backend})
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        _build(spec, _config())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_attn_backend_on_gpu(model_parallel):
    pytest.importorskip("flash_attn")
    config = _config(heads=4, groups=2)
    ours = _build(build_core_attention_spec("flash-attn"), config).cuda()
    torch_ref = _build(build_core_attention_spec("torch"), config).cuda()
    q, k, v = (t.detach().cuda().requires_grad_() for t in _inputs(64, 2, 4, 2, config.kv_channels))
    out = ours(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    ref = torch_ref(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2
