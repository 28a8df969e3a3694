"""Full-softmax logit capture on DeepSpeed's TopKGate: only while armed, only in training mode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed.moe.sharded_moe import TopKGate  # noqa: E402

from mechmon_megatron.adapters.deepspeed.gate_capture import find_gates, install_gate_capture  # noqa: E402
from mechmon_megatron.monitors.router import summarize_routing  # noqa: E402
from mechmon_megatron.session.host import RouterSite  # noqa: E402


def _site() -> RouterSite:
    return RouterSite(layer_number=1, num_experts=4, topk=2, weight=lambda: None, reduce_sum=lambda v: v, reports=True)


def test_capture_recomputes_logits_on_armed_training_forwards():
    torch.manual_seed(0)
    gate = TopKGate(16, 4, k=2, top2_2nd_expert_sampling=False)
    site, armed = _site(), {"on": False}
    handle = install_gate_capture(gate, site, lambda: armed["on"])
    tokens = torch.randn(10, 16)

    gate(tokens)  # not armed: nothing kept
    assert site.summary is None
    armed["on"] = True
    gate(tokens)
    # Reduced in the hook to the summary of the gate's full logits (brute force: the gate's weight).
    expected = summarize_routing(tokens @ gate.wg.weight.detach().t(), 2, num_bins=site.num_bins).to_flat_tensor()
    torch.testing.assert_close(site.summary, expected)
    assert not site.summary.requires_grad and site.micro_batches == 1

    gate.eval()  # eval forwards are not training statistics
    gate(tokens)
    assert site.micro_batches == 1

    gate.train()
    site.take_summary()
    used = torch.tensor([1, 0] * 5)
    gate(tokens, used)
    assert float(site.summary[0]) == 5  # masked tokens left out, as the gate does

    with pytest.raises(RuntimeError, match="already has a mechmon capture hook"):
        install_gate_capture(gate, site, lambda: True)
    handle.remove()


def test_find_gates_in_module_order():
    model = torch.nn.ModuleDict({"a": TopKGate(8, 2), "b": torch.nn.Linear(2, 2), "c": TopKGate(8, 2)})
    assert [name for name, _ in find_gates(model)] == ["a", "c"]
