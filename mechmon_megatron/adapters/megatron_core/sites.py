"""Turn megatron-core modules into the session's sites, handling TP / DP / EP / SP layouts.

Who computes what (so every value is produced exactly once):
* Attention: only the first data-parallel replica (DP rank 0, context-parallel included) lists
  attention sites. Within its tensor-parallel group each rank reports its own ``np / tp`` query
  heads -- sliced locally when it holds whole query groups (ng >= tp), otherwise from the
  TP-gathered weight (ng < tp). The full-matrix dW of layer L is computed on TP rank
  ``(L - 1) % tp`` (round-robin) from the gathered weight.
* Routers: every rank lists them; token statistics are summed over the data-parallel group (plus
  the TP group under sequence parallelism, where TP ranks route different tokens); one rank per
  pipeline stage (DP rank 0, TP rank 0) reports.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mechmon_megatron.adapters.megatron_core.discovery import FoundAttention, FoundRouter
from mechmon_megatron.session.host import AttentionSite, FullQK, QKWeights, RouterSite
from mechmon_megatron.session.qkv_layout import split_qk


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _group_rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _all_gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate the TP shards of a row-sharded weight (plain collective, no autograd)."""
    size = _group_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _AttentionReader:
    """Reads per-head and full Q/K weights of one SelfAttention on one rank."""

    def __init__(self, found: FoundAttention, tp_group: Any, full_matrix: bool) -> None:
        module = found.module
        self.full_matrix = full_matrix
        cfg = module.config
        self.layer_number = found.layer_number
        self.weight = module.linear_qkv.weight
        self.tp_group = tp_group
        self.tp = _group_size(tp_group)
        self.tp_rank = _group_rank(tp_group)
        self.np = cfg.num_attention_heads
        self.ng = cfg.num_query_groups or cfg.num_attention_heads
        self.hn = module.hidden_size_per_attention_head
        self.gate = bool(getattr(cfg, "attention_output_gate", False))
        self.np_local = self.np // self.tp
        self.owner = (self.layer_number - 1) % self.tp == self.tp_rank
        self._gathered: Optional[torch.Tensor] = None

    def _full_weight(self) -> torch.Tensor:
        if self._gathered is None:
            self._gathered = _all_gather_rows(self.weight.detach(), self.tp_group)
        return self._gathered

    def read_full(self) -> Optional[FullQK]:
        """Full Q/K of the layer on its owning TP rank (None elsewhere). Collective when tp > 1."""
        # Called first in every check/snapshot: gather once, reuse in read_heads, then drop.
        self._gathered = None
        if not self.full_matrix and self.ng >= self.tp:
            return None
        full = self._full_weight() if self.tp > 1 else self.weight.detach()  # every TP rank joins
        if not (self.full_matrix and self.owner):
            return None
        wq, wk = split_qk(full, self.np, self.ng, self.hn, self.gate)
        return FullQK(wq=wq.reshape(self.np * self.hn, -1), wk=wk.reshape(self.ng * self.hn, -1))

    def read_heads(self) -> QKWeights:
        offset = self.tp_rank * self.np_local
        if self.ng >= self.tp:
            wq, wk = split_qk(self.weight.detach(), self.np_local, self.ng // self.tp, self.hn, self.gate)
            self._gathered = None
            return QKWeights(wq=wq, wk=wk, head_offset=offset)
        # ng < tp: a query group spans ranks; read_full already gathered the weight this round.
        wq_all, wk_all = split_qk(self._full_weight(), self.np, self.ng, self.hn, self.gate)
        self._gathered = None
        group = offset // (self.np // self.ng)  # np/tp heads of one rank share one group
        return QKWeights(wq=wq_all[offset : offset + self.np_local], wk=wk_all[group : group + 1], head_offset=offset)


def attention_sites(found: list[FoundAttention], tp_group: Any, full_matrix: bool) -> list[AttentionSite]:
    sites = []
    for item in found:
        group = getattr(item.module, "tp_group", None) or tp_group
        reader = _AttentionReader(item, group, full_matrix)
        sites.append(AttentionSite(item.layer_number, reader.read_heads, reader.read_full, item.name))
    return sites


def router_sites(
    found: list[FoundRouter], reduce_group: Any, reports: bool, capture_enabled: Callable[[], bool]
) -> list[RouterSite]:
    """Router sites plus a capture wrapper around each router's ``gating`` (logits ``[s, b, E]``)."""
    sites = []
    for item in found:
        module = item.module

        def reduce_sum(vector: torch.Tensor, _group=reduce_group, _device=module.weight.device) -> torch.Tensor:
            if not dist.is_initialized() or _group_size(_group) == 1:
                return vector
            # fp64 for exact integer counts; NCCL needs the tensor on the module's device.
            work = vector.to(device=_device, dtype=torch.float64)
            dist.all_reduce(work, group=_group)
            return work.cpu()

        site = RouterSite(
            layer_number=item.layer_number,
            num_experts=int(module.weight.shape[0]),
            topk=int(module.topk),
            weight=(lambda _m=module: _m.weight),
            reduce_sum=reduce_sum,
            reports=reports,
            name=item.name,
        )
        install_logit_capture(module, site, capture_enabled)
        sites.append(site)
    return sites


def install_logit_capture(router: torch.nn.Module, site: RouterSite, capture_enabled) -> None:
    """Wrap ``router.gating`` (instance attribute) to keep its logits on check steps only.

    megatron-core's router returns only sparse top-k probabilities; the full softmax is never
    materialised, so we keep the logits and softmax them ourselves. On other steps the wrapper
    costs one boolean test.
    """
    if getattr(router, "_mechmon_capture", False):
        raise RuntimeError(f"router {site.name} already has a mechmon capture hook (attach the session once)")
    original = router.gating

    def gating(input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        logits = original(input, *args, **kwargs)
        if capture_enabled():
            site.captured_logits.append(logits.detach())
        return logits

    router.gating = gating
    router._mechmon_capture = True
