"""Full-softmax logit capture on DeepSpeed's TopKGate: only while armed, only in training mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _OpLog(TorchDispatchMode):
    """Every aten op run inside the block (CPU stands in for the accelerator: an op that reads a
    value back to the host, or sizes its output from the data, is one that syncs on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        if func.overloadpacket is torch.ops.aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
                if i is not None):
            self.ops.append("bool-mask-index")
        return func(*args, **(kwargs or {}))


DATA_DEPENDENT = {"aten.nonzero", "aten._local_scalar_dense", "aten.masked_select", "aten.item", "bool-mask-index"}


@pytest.mark.parametrize("seed", [0, 1])
def test_used_token_mask_equals_boolean_indexing_and_never_syncs(seed: int):
    """The used_token mask inside the summary gives the summary of the kept tokens alone (the old
    formulation, ``logits[used_token != 0]``), with no data-dependent op in the forward hook."""
    torch.manual_seed(seed)
    gate = TopKGate(16, 4, k=2, top2_2nd_expert_sampling=False)
    site = _site()
    install_gate_capture(gate, site, lambda: True)
    tokens = torch.randn(3, 7, 16)
    tokens[0, 2] = float("nan")  # one non-finite token among the kept ones, one among the masked
    tokens[1, 5] = float("inf")
    used = (torch.rand(21) > 0.4).long()
    used[2], used[12] = 1, 0
    (hook,) = gate._forward_pre_hooks.values()  # the capture hook alone, not the gate's own routing
    with _OpLog() as log:
        hook(gate, (tokens, used))
    assert site.capture_error is None and site.micro_batches == 1
    assert not DATA_DEPENDENT & set(log.ops), sorted(DATA_DEPENDENT & set(log.ops))

    flat = tokens.reshape(-1, 16)
    old = (flat @ gate.wg.weight.detach().t())[used != 0]  # the old, syncing formulation
    expected = summarize_routing(old, 2, num_bins=site.num_bins).to_flat_tensor()
    torch.testing.assert_close(site.summary, expected, rtol=0, atol=1e-12)
    assert float(site.summary[0]) == int(used.sum()) - 1  # kept tokens, less the non-finite one


def test_find_gates_in_module_order():
    model = torch.nn.ModuleDict({"a": TopKGate(8, 2), "b": torch.nn.Linear(2, 2), "c": TopKGate(8, 2)})
    assert [name for name, _ in find_gates(model)] == ["a", "c"]
