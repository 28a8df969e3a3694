"""Router statistics are reduced inside the forward hook: no logits kept, no host sync.

The CUDA test is part of tools/gpu_check.sh; on CPU the exactness test runs.
"""

from __future__ import annotations

import pytest
import torch

from mechmon_megatron.monitors.router import summarize_routing
from mechmon_megatron.session.host import RouterSite

EXPERTS, TOPK = 8, 2


def _site(bins: int = 64, score_function: str = "softmax") -> RouterSite:
    return RouterSite(layer_number=1, num_experts=EXPERTS, topk=TOPK, weight=lambda: torch.zeros(EXPERTS, 4),
                      reduce_sum=lambda v: v, reports=True, num_bins=bins, score_function=score_function)


def _routing_maps(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """A routing map unlike top-k of the logits (as with an expert bias): expert 0 always, then the best other."""
    maps = []
    for logits in batches:
        flat = logits.reshape(-1, EXPERTS)
        m = torch.zeros_like(flat, dtype=torch.bool)
        m[:, 0] = True
        m.scatter_(1, flat[:, 1:].argmax(dim=-1, keepdim=True) + 1, True)
        maps.append(m)
    return maps


def _micro_batches(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 2, EXPERTS, generator=g).to(device) for _ in range(3)]


def test_summary_of_micro_batches_equals_the_summary_of_all_their_tokens():
    site = _site()
    batches = _micro_batches("cpu")
    for logits in batches:
        site.capture(logits)
    expected = summarize_routing(torch.cat([b.reshape(-1, EXPERTS) for b in batches]), TOPK, num_bins=64)
    torch.testing.assert_close(site.summary, expected.to_flat_tensor(), rtol=1e-12, atol=1e-9)
    assert site.micro_batches == 3 and site.capture_error is None
    summary, error = site.take_summary()
    assert summary is not None and error is None and site.summary is None  # reset for the next check


def test_sigmoid_site_with_routing_map_equals_the_summary_of_all_tokens():
    site = _site(score_function="sigmoid")
    batches = _micro_batches("cpu")
    maps = _routing_maps(batches)
    for logits, routing_map in zip(batches, maps):
        site.capture(logits, routing_map)
    expected = summarize_routing(torch.cat([b.reshape(-1, EXPERTS) for b in batches]), TOPK, num_bins=64,
                                 routing_map=torch.cat(maps), score_function="sigmoid")
    torch.testing.assert_close(site.summary, expected.to_flat_tensor(), rtol=1e-12, atol=1e-9)
    assert expected.expert_counts[0].item() == 3 * 32  # the map, not top-k of the logits
    softmax = summarize_routing(torch.cat([b.reshape(-1, EXPERTS) for b in batches]), TOPK, num_bins=64)
    assert not torch.equal(expected.entropy_sum, softmax.entropy_sum)


def test_token_mask_equals_the_summary_of_the_kept_tokens_alone():
    """DeepSpeed's used_token: the mask inside the summary == summarising the kept rows only."""
    site = _site()
    batches = _micro_batches("cpu")
    batches[1][3, 0, 2] = float("nan")  # a masked non-finite token (index 6) is not reported
    masks = [(torch.arange(32) % 3 != 0).long() for _ in batches]
    masks[1][6] = 0
    for logits, mask in zip(batches, masks):
        site.capture(logits, token_mask=mask)
    kept = torch.cat([b.reshape(-1, EXPERTS)[m != 0] for b, m in zip(batches, masks)])
    expected = summarize_routing(kept, TOPK, num_bins=64)
    torch.testing.assert_close(site.summary, expected.to_flat_tensor(), rtol=0, atol=1e-12)
    assert expected.num_nonfinite.item() == 0 and expected.num_tokens.item() == sum(int(m.sum()) for m in masks)
    with pytest.raises(ValueError, match="token_mask must have one entry per token"):
        summarize_routing(batches[0], TOPK, token_mask=torch.ones(5))


def test_a_failing_capture_is_kept_for_the_check_and_never_raises_in_the_forward():
    site = _site()
    site.capture(torch.randn(4, 3))  # 3 != 8 experts: the summary cannot be added
    site.capture(torch.randn(4, EXPERTS))
    summary, error = site.take_summary()
    assert error is not None  # the check raises it (counted), the partial summary is not used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check.sh)")
@pytest.mark.parametrize("score_function, with_map, with_mask",
                         [("softmax", False, False), ("sigmoid", True, False), ("sqrtsoftplus", True, False),
                          ("softmax", False, True)])
def test_capture_on_cuda_never_synchronises_with_the_host(score_function, with_map, with_mask):
    site = _site(bins=512, score_function=score_function)
    batches = _micro_batches("cuda")
    maps = _routing_maps(batches) if with_map else [None] * len(batches)
    # DeepSpeed's used_token mask (gate_capture.py): a mask inside the summary, no boolean indexing.
    masks = [(torch.arange(32, device="cuda") % 3 != 0).long() if with_mask else None for _ in batches]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync raises
    try:
        for logits, routing_map, mask in zip(batches, maps, masks):
            # As the megatron-core adapter does with moe_pad_expert_input_to_capacity.
            routed = None if routing_map is None else routing_map & (logits.reshape(-1, EXPERTS) != 0)
            site.capture(logits, routed, token_mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert site.capture_error is None, site.capture_error
    assert site.summary is not None and site.summary.device.type == "cuda"
