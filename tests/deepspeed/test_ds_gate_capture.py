"""Full-softmax logit capture on DeepSpeed's TopKGate: only while armed, only in training mode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed.moe.sharded_moe import TopKGate  # noqa: E402

from mechmon_megatron.adapters.deepspeed.gate_capture import find_gates, install_gate_capture  # noqa: E402
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
    assert site.captured_logits == []
    armed["on"] = True
    gate(tokens)
    (logits,) = site.captured_logits
    torch.testing.assert_close(logits, tokens @ gate.wg.weight.detach().t())
    assert not logits.requires_grad

    gate.eval()  # eval forwards are not training statistics
    gate(tokens)
    assert len(site.captured_logits) == 1

    gate.train()
    site.captured_logits.clear()
    used = torch.tensor([1, 0] * 5)
    gate(tokens, used)
    assert site.captured_logits[0].shape == (5, 4)  # masked tokens left out, as the gate does

    with pytest.raises(RuntimeError, match="already has a mechmon capture hook"):
        install_gate_capture(gate, site, lambda: True)
    handle.remove()


def test_find_gates_in_module_order():
    model = torch.nn.ModuleDict({"a": TopKGate(8, 2), "b": torch.nn.Linear(2, 2), "c": TopKGate(8, 2)})
    assert [name for name, _ in find_gates(model)] == ["a", "c"]
