"""Tests of the emulated low-precision FlashAttention kernel and the fault configuration."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mechmon_megatron.research.faults import emulated_fa
from mechmon_megatron.research.faults.emulated_fa import (
    EmulatedFAConfig,
    emulated_flash_attention,
    round_bf16,
    ulp_bf16,
)
from mechmon_megatron.research.faults.fault_config import FaultConfig

EXACT = EmulatedFAConfig(block_q=16, block_k=24, emulate_bf16=False)
BF16 = EmulatedFAConfig(block_q=16, block_k=24)


def _qkv(b=2, h=3, n=50, d=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def _grads(out, inputs, d_out):
    return torch.autograd.grad(out, inputs, d_out)


def _reference(q, k, v, causal=True, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# Agreement with plain attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blocks", [(16, 24), (64, 64), (7, 5)])
def test_exact_path_matches_autograd_attention(causal, blocks):
    q, k, v = _qkv()
    cfg = EmulatedFAConfig(block_q=blocks[0], block_k=blocks[1], emulate_bf16=False)
    out = emulated_flash_attention(q, k, v, causal=causal, config=cfg, softmax_scale=0.3)
    ref = _reference(q, k, v, causal=causal, scale=0.3)
    d_out = torch.randn_like(ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(out, (q, k, v), d_out), _grads(ref, (q, k, v), d_out)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_emulation_matches_within_bf16_tolerance():
    q, k, v = _qkv()
    out = emulated_flash_attention(q, k, v, config=BF16)
    ref = _reference(q, k, v)
    d_out = torch.randn_like(ref)
    assert _rel(out, ref) < 1e-2
    assert torch.equal(out, round_bf16(out)), "O must be BF16-representable"
    for got, want in zip(_grads(out, (q, k, v), d_out), _grads(ref, (q, k, v), d_out)):
        assert _rel(got, want) < 2e-2
        assert torch.equal(got, round_bf16(got))


def test_bf16_emulation_actually_rounds():
    q, k, v = _qkv()
    exact = emulated_flash_attention(q, k, v, config=EXACT)
    emulated = emulated_flash_attention(q, k, v, config=BF16)
    assert not torch.equal(exact, emulated)


def test_fp32_o_control_arm_keeps_o_unrounded():
    q, k, v = _qkv()
    out = emulated_flash_attention(q, k, v, config=EmulatedFAConfig(fp32_o=True))
    assert not torch.equal(out, round_bf16(out))
    assert _rel(out, _reference(q, k, v)) < 1e-2


def test_finite_difference_gradcheck_fp64():
    q, k, v = _qkv(b=1, h=2, n=5, d=3, dtype=torch.float64)
    cfg = EmulatedFAConfig(block_q=2, block_k=3, emulate_bf16=False)
    for causal in (True, False):
        assert torch.autograd.gradcheck(
            lambda a, b, c, causal=causal: emulated_flash_attention(a, b, c, causal=causal, config=cfg), (q, k, v)
        )


def test_low_precision_inputs_are_computed_in_fp32_and_cast_back():
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in _qkv(n=20))
    out = emulated_flash_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16


def test_input_validation():
    q, k, v = _qkv(n=8)
    with pytest.raises(ValueError, match="equal query and key lengths"):
        emulated_flash_attention(q, k[:, :, :4], v[:, :, :4], causal=True)
    with pytest.raises(ValueError, match="repeat GQA groups first"):
        emulated_flash_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="block_q and block_k must be >= 1"):
        EmulatedFAConfig(block_q=0)
    with pytest.raises(ValueError, match="tie_shift_beta must be > 1"):
        EmulatedFAConfig(tie_shift_beta=0.5)
    with pytest.raises(ValueError, match="tie_shift_cap must be in"):
        EmulatedFAConfig(tie_shift_cap=100.0)


# ---------------------------------------------------------------------------------------------
# ulp_bf16


def test_ulp_bf16_known_values():
    x = torch.tensor([0.0, 1.0, 1.5, -2.0, 0.999, 3.0e38, 1e-40])
    want = torch.tensor([0.0, 2.0**-7, 2.0**-7, 2.0**-6, 2.0**-8, 2.0**120, 2.0**-133])
    assert torch.equal(ulp_bf16(x), want)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_subnormal=False).filter(
        lambda x: abs(x) > 1e-30
    )
)
def test_ulp_bf16_is_the_bf16_spacing(value):
    xb = torch.tensor([value]).to(torch.bfloat16)
    up = torch.nextafter(xb, torch.full_like(xb, math.copysign(math.inf, value)))
    assert ulp_bf16(xb.float()).item() == (up.float() - xb.float()).abs().item()


# ---------------------------------------------------------------------------------------------
# Fault injector


def _with_fault(q, k, v, d_out, fault, cfg=BF16):
    out = emulated_flash_attention(q, k, v, config=cfg, fault=fault)
    return out, _grads(out, (q, k, v), d_out)


def test_fault_changes_only_gradients_with_the_predicted_structure():
    q, k, v = _qkv()
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))  # fixed: see tests/README.md
    out0, (dq0, dk0, dv0) = _with_fault(q, k, v, d_out, None, cfg=EXACT)
    fault = FaultConfig(strength=8.0)
    out1, (dq1, dk1, dv1) = _with_fault(q, k, v, d_out, fault, cfg=EXACT)
    assert torch.equal(out0, out1), "the forward output must be bit-identical"
    assert torch.equal(dv0, dv1), "dV = P^T dO does not involve delta"
    # delta error e_i = sum_d dO * s * ulp(O) * sign(O); dS_ij changes by -P_ij e_i.
    with torch.no_grad():
        e = (d_out * fault.strength * ulp_bf16(out0) * torch.sign(out0)).sum(-1, keepdim=True)
        p = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(
            torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1), -math.inf), dim=-1)
        want_dq = -scale * e * (p @ k)
        want_dk = -scale * (p * e).transpose(-1, -2) @ q
    torch.testing.assert_close(dq1 - dq0, want_dq, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(dk1 - dk0, want_dk, atol=1e-6, rtol=1e-4)
    assert want_dq.abs().max() > 0


def test_fault_sign_and_scale():
    q, k, v = _qkv()
    with torch.no_grad():
        out = emulated_flash_attention(q, k, v, config=BF16)
    d_out = torch.sign(out)  # makes every delta error e_i = s * sum_d ulp(O) >= 0 for s > 0
    _, (dq0, _, _) = _with_fault(q, k, v, d_out, None)
    _, (dq_pos, _, _) = _with_fault(q, k, v, d_out, FaultConfig(strength=16.0))
    _, (dq_neg, _, _) = _with_fault(q, k, v, d_out, FaultConfig(strength=-16.0))
    _, (dq_big, _, _) = _with_fault(q, k, v, d_out, FaultConfig(strength=64.0))
    pos, neg, big = dq_pos - dq0, dq_neg - dq0, dq_big - dq0
    assert pos.abs().max() > 0
    # Opposite strengths push opposite ways; a 4x strength gives ~4x the change (BF16 dQ rounding).
    assert (pos * neg).sum() < 0
    ratio = (big.norm() / pos.norm()).item()
    assert 3.0 < ratio < 5.0
    # The change is a rank-one-per-row structure: dQ_i changes along -(P K)_i for every row.
    _, (dq_e0, _, _) = _with_fault(q, k, v, d_out, None, cfg=EXACT)
    _, (dq_e1, _, _) = _with_fault(q, k, v, d_out, FaultConfig(strength=16.0), cfg=EXACT)
    assert _rel(pos, dq_e1 - dq_e0) < 0.2


def test_fault_before_onset_is_a_noop_and_switches_on_at_onset():
    q, k, v = _qkv()
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))  # fixed: see tests/README.md
    _, base = _with_fault(q, k, v, d_out, None)
    fault = FaultConfig(strength=16.0, onset_step=100)
    fault.set_step(99)
    _, before = _with_fault(q, k, v, d_out, fault)
    for got, want in zip(before, base):
        assert torch.equal(got, want)
    fault.set_step(100)
    _, after = _with_fault(q, k, v, d_out, fault)
    assert not torch.equal(after[0], base[0])


def test_zero_strength_is_a_noop():
    q, k, v = _qkv()
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))  # fixed: see tests/README.md
    _, base = _with_fault(q, k, v, d_out, None)
    _, off = _with_fault(q, k, v, d_out, FaultConfig(strength=0.0))
    assert all(torch.equal(a, b) for a, b in zip(base, off))


def test_tied_rows_mode_is_a_noop_without_ties():
    q, k, v = _qkv()
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))  # fixed: see tests/README.md
    _, base = _with_fault(q, k, v, d_out, None)
    _, tied = _with_fault(q, k, v, d_out, FaultConfig(strength=64.0, mode="tied_rows"))
    assert all(torch.equal(a, b) for a, b in zip(base, tied))


def _tied_inputs(n=40, d=8):
    """Keys 0 and 1 identical and aligned with every query: rows i >= 1 have a tied max."""
    q, k, v = (t.detach() for t in _qkv(b=1, h=2, n=n, d=d))
    direction = torch.ones(d)
    q = q * 0.1 + 2.0 * direction
    k = k * 0.1
    k[:, :, 0] = 3.0 * direction
    k[:, :, 1] = 3.0 * direction
    return [t.requires_grad_() for t in (q, k, v)]


def test_tied_rows_mode_acts_only_on_tied_rows():
    q, k, v = _tied_inputs()
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))  # fixed: see tests/README.md
    _, (dq0, _, _) = _with_fault(q, k, v, d_out, None)
    out, (dq1, _, _) = _with_fault(q, k, v, d_out, FaultConfig(strength=64.0, mode="tied_rows"))
    changed = (dq1 - dq0).abs().amax(dim=-1) > 0  # [B, H, N]
    assert not changed[:, :, 0].any(), "row 0 sees one key: not tied"
    assert changed[:, :, 1:].all()


def test_tie_shift_fix_keeps_output_and_makes_p_bar_below_one(monkeypatch):
    q, k, v = _tied_inputs()
    recorded = []
    original = emulated_fa._p_bar

    def recording_p_bar(s, m_used):
        p = original(s, m_used)
        recorded.append(p.detach())
        return p

    monkeypatch.setattr(emulated_fa, "_p_bar", recording_p_bar)
    cfg = dict(block_q=16, block_k=16)
    base = emulated_flash_attention(q, k, v, config=EmulatedFAConfig(**cfg))
    # Tile 0 (rows 0..15, keys 0..15) holds the tied keys 0, 1; row 0 sees key 0 only (untied).
    base_max = recorded[0][:, :, 1:].amax().item()
    recorded.clear()
    fixed = emulated_flash_attention(q, k, v, config=EmulatedFAConfig(tie_shift_beta=2.0, **cfg))
    fixed_max = max([recorded[0][:, :, 1:].amax().item()] + [p.amax().item() for p in recorded[1:]])
    assert recorded[0][:, :, 0].amax().item() == 1.0
    assert base_max == 1.0, "without the fix the tied maxima give P_bar == 1"
    assert fixed_max < 1.0
    assert _rel(fixed, base) < 1e-2
    exact = EmulatedFAConfig(emulate_bf16=False, **cfg)
    exact_fixed = EmulatedFAConfig(emulate_bf16=False, tie_shift_beta=4.0, **cfg)
    torch.testing.assert_close(
        emulated_flash_attention(q, k, v, config=exact_fixed),
        emulated_flash_attention(q, k, v, config=exact),
        atol=1e-5, rtol=1e-5,
    )


def test_tie_shift_handles_negative_tied_max_and_suppresses_tied_rows_fault():
    q, k, v = _tied_inputs()
    q = (-q.detach()).requires_grad_()  # tied max is now negative: shifted to m = 0
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))  # fixed: see tests/README.md
    cfg = EmulatedFAConfig(emulate_bf16=False, tie_shift_beta=2.0)
    out, base = _with_fault(q, k, v, d_out, None, cfg=cfg)
    torch.testing.assert_close(out, _reference(q, k, v), atol=1e-5, rtol=1e-5)
    _, faulted = _with_fault(q, k, v, d_out, FaultConfig(strength=64.0, mode="tied_rows"), cfg=cfg)
    assert all(torch.equal(a, b) for a, b in zip(base, faulted))


def test_exact_path_gradients_unaffected_by_tie_shift():
    q, k, v = _tied_inputs()  # tied max ~17 nats: beta * m = 136 would underflow without the cap
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))  # fixed: see tests/README.md
    ref = _reference(q, k, v)
    cfg = EmulatedFAConfig(emulate_bf16=False, tie_shift_beta=8.0, block_q=8, block_k=8)
    out, grads = _with_fault(q, k, v, d_out, None, cfg=cfg)
    for got, want in zip(grads, _grads(ref, (q, k, v), d_out)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# FaultConfig


def test_fault_config_validation_messages():
    with pytest.raises(ValueError, match="fault.mode must be one of"):
        FaultConfig(mode="some_rows")
    with pytest.raises(ValueError, match="fault.onset_step must be >= 0"):
        FaultConfig(onset_step=-1)
    with pytest.raises(ValueError, match="fault.strength must be a finite number"):
        FaultConfig(strength=math.inf)
    with pytest.raises(ValueError, match="1-based global layer numbers"):
        FaultConfig(layer_numbers=(0,))


def test_fault_config_activity():
    fault = FaultConfig(strength=8.0, onset_step=10, layer_numbers=[2])
    assert fault.layer_numbers == (2,)
    assert fault.enabled and not fault.is_active()
    fault.set_step(10)
    assert fault.is_active()
    assert fault.applies_to_layer(2) and not fault.applies_to_layer(1)
    assert not FaultConfig().enabled
    assert FaultConfig().applies_to_layer(7)
