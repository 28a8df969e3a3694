"""Turn megatron-core multi-head latent attention (``MLASelfAttention``) into the session's sites.

What is read, per layer (docs/METHOD.md section 4b; Megatron rows ``[out, in]``):

* the projections from the hidden state: ``linear_q_down_proj`` ``[q_lora_rank, H]`` (or, without a
  query latent, ``linear_q_proj`` ``[n_h d_qk, H]``, split by head over TP) and
  ``linear_kv_down_proj`` ``[kv_lora_rank + d_rope, H]``, or the fused ``linear_qkv_down_proj``
  ``[q_lora_rank + kv_lora_rank + d_rope, H]`` (``FusedMLASelfAttention``). With Transformer
  Engine they are replicated over TP ranks (``parallel_mode="duplicated"``); with the local spec
  they are ``ColumnParallelLinear`` row shards, gathered here. Which one is decided from the shape;
* the latent norms' gammas: ``q_layernorm`` / ``kv_layernorm``, or fused into the up projection
  (``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``);
* the up projections of this rank's heads: ``linear_q_up_proj`` ``[n_h/tp * d_qk, q_lora_rank]`` and
  the KEY rows of ``linear_kv_up_proj`` (per head ``d_nope`` key rows then ``d_v`` value rows;
  the value rows never enter a logit and are not kept).

Who computes what mirrors ``sites.py``: the per-head work of layer L runs on data-parallel
replica ``(L - 1) % dp``, where each TP rank reports its own ``n_h / tp`` heads (every TP rank
there also factors the shared down projections: the per-head cost is of the size of the latent
rank, docs/METHOD.md section 4b); the full-matrix dW of the two projections from the hidden state
runs on rank ``j = (L - 1) % (dp * tp)`` of the DP x TP grid.

A layer whose shapes do not reconcile with its config, an absorbed layer (``cache_mla_latents``
deletes ``linear_kv_up_proj``) or a LayerNorm-normalised latent raise :class:`UnsupportedLayout`
at start-up; ``attention_sites`` leaves that layer out and names it once.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from mechmon_megatron.adapters.megatron_core.discovery import FoundAttention
from mechmon_megatron.adapters.megatron_core.norms import (
    GammaReader,
    UnsupportedLayout,
    WeightSource,
    fused_norm_spec,
    norm_spec,
)
from mechmon_megatron.adapters.megatron_core.tp_gather import read_and_gather_rows
from mechmon_megatron.monitors.mla_increment import MLAWeights
from mechmon_megatron.session.collective_guard import CollectiveGuard
from mechmon_megatron.session.host import FullQK, MLAHeads, SnapshotBudget


def is_mla(module: Any) -> bool:
    """A megatron-core ``MLASelfAttention`` (or a subclass), recognised by its latent projections."""
    return hasattr(module, "config") and hasattr(module, "layer_number") and (
        hasattr(module, "linear_kv_down_proj") or hasattr(module, "linear_qkv_down_proj"))


class _Tensor:
    """One parameter as the site reads it: local shard or whole, gathered over TP when split."""

    def __init__(self, param: torch.nn.Parameter, rows: int, tp: int, what: str,
                 weight_source: Optional[WeightSource], uses: bool, split_ok: bool = True) -> None:
        local_rows = int(param.shape[0])
        if local_rows == rows:
            self.split = False
        elif split_ok and tp > 1 and local_rows * tp == rows:
            self.split = True
        else:
            raise UnsupportedLayout(f"{what} has {local_rows} rows on this rank, expected {rows}"
                                    + (f" (or {rows} / {tp} per TP rank)" if tp > 1 else ""))
        self.param = param
        self.what = what
        self.read: Callable[[], Optional[torch.Tensor]] = (
            weight_source(param) if weight_source is not None else (lambda: param.detach()))
        configure = getattr(self.read, "configure_use", None)
        if callable(configure):
            configure(uses, None)


class MLAReader:
    """Reads one MLA layer's per-head and full-matrix weights on one rank (its gathers through ``guard``)."""

    def __init__(self, found: FoundAttention, tp_group: Any, full_matrix: bool, dp_rank: int, dp: int,
                 weight_source: Optional[WeightSource], tp: int, tp_rank: int, guard: CollectiveGuard) -> None:
        module = found.module
        cfg = module.config
        self.layer_number = found.layer_number
        self.tp_group, self.tp, self.tp_rank = tp_group, tp, tp_rank
        self.guard = guard
        if not hasattr(module, "linear_kv_up_proj"):
            raise UnsupportedLayout("absorbed MLA (cache_mla_latents removed linear_kv_up_proj)")
        self.n_h = int(cfg.num_attention_heads)
        if self.n_h % tp:
            raise UnsupportedLayout(f"{self.n_h} heads do not split over {tp} TP ranks")
        self.np_local = self.n_h // tp
        self.d_nope, self.d_rope, self.d_v = int(cfg.qk_head_dim), int(cfg.qk_pos_emb_head_dim), int(cfg.v_head_dim)
        self.r_q = None if cfg.q_lora_rank is None else int(cfg.q_lora_rank)
        self.r_kv = int(cfg.kv_lora_rank)
        d_qk = self.d_nope + self.d_rope
        index = self.layer_number - 1
        self.heads_owner = index % dp == dp_rank
        full_replica = full_matrix and (index % (dp * tp)) // tp == dp_rank
        self.full_owner = full_replica and index % (dp * tp) % tp == tp_rank
        self.full_replica = full_replica
        self.works = self.heads_owner or full_replica
        down_rows_kv = self.r_kv + self.d_rope

        # The projections from the hidden state.
        self.fused_down: Optional[_Tensor] = None
        self.q_down = self.kv_down = self.q_proj = None
        if hasattr(module, "linear_qkv_down_proj"):
            if self.r_q is None:
                raise UnsupportedLayout("linear_qkv_down_proj without q_lora_rank")
            self.fused_down = _Tensor(module.linear_qkv_down_proj.weight, self.r_q + down_rows_kv, tp,
                                      "linear_qkv_down_proj", weight_source, self.works)
        else:
            if self.r_q is not None:
                self.q_down = _Tensor(module.linear_q_down_proj.weight, self.r_q, tp, "linear_q_down_proj",
                                      weight_source, self.works)
            self.kv_down = _Tensor(module.linear_kv_down_proj.weight, down_rows_kv, tp, "linear_kv_down_proj",
                                   weight_source, self.works)
        if self.r_q is None:
            # Split by head over TP, like the up projections; whole only for the full-matrix dW.
            self.q_proj = _Tensor(module.linear_q_proj.weight, self.n_h * d_qk, tp, "linear_q_proj", weight_source,
                                  self.works)
            if tp > 1 and not self.q_proj.split:
                raise UnsupportedLayout("linear_q_proj is not split by head over TP ranks")
        else:
            self.q_up = self._up(module.linear_q_up_proj.weight, d_qk, "linear_q_up_proj", weight_source)
        self.kv_up = self._up(module.linear_kv_up_proj.weight, self.d_nope + self.d_v, "linear_kv_up_proj",
                              weight_source)

        # The latent norms (RMSNorm: the monitors fold its gamma; a LayerNorm would also centre
        # the latent, which the kernel does not take).
        q_norm = None
        if self.r_q is not None:
            q_norm = (norm_spec(getattr(module, "q_layernorm", None), cfg, "q_layernorm", self.r_q)
                      or fused_norm_spec(module.linear_q_up_proj, cfg, "linear_q_up_proj", self.r_q))
        kv_norm = (norm_spec(getattr(module, "kv_layernorm", None), cfg, "kv_layernorm", self.r_kv)
                   or fused_norm_spec(module.linear_kv_up_proj, cfg, "linear_kv_up_proj", self.r_kv))
        for spec, what in ((q_norm, "query latent norm"), (kv_norm, "key/value latent norm")):
            if spec is not None and spec.centres:
                raise UnsupportedLayout(f"the {what} is a LayerNorm (centring is not folded for MLA; RMSNorm is)")
        self.q_norm = None if q_norm is None else GammaReader(q_norm, weight_source, self.heads_owner)
        self.kv_norm = None if kv_norm is None else GammaReader(kv_norm, weight_source, self.heads_owner)
        self._read: Optional[dict[str, Optional[torch.Tensor]]] = None
        if tp > 1:
            guard.declare(tp_group)  # mechmon's own copy, for the gathers of row-split projections

    def _up(self, param: torch.nn.Parameter, per_head: int, what: str, weight_source: Optional[WeightSource]):
        rows = self.np_local * per_head
        if int(param.shape[0]) != rows:
            raise UnsupportedLayout(f"{what} has {int(param.shape[0])} rows on this rank, expected "
                                    f"{self.np_local} heads x {per_head}")
        reader = weight_source(param) if weight_source is not None else (lambda: param.detach())
        configure = getattr(reader, "configure_use", None)
        if callable(configure):
            configure(self.heads_owner, None)
        return reader

    # ------------------------------------------------------------------ reads
    def _whole(self, tensor: _Tensor, gather: bool) -> Optional[torch.Tensor]:
        if tensor.split and gather:
            _, whole = read_and_gather_rows(tensor.read, self.tp_group,
                                             f"layer {self.layer_number} {tensor.what}", self.guard)
            return whole
        return tensor.read()

    def read_full(self) -> Optional[FullQK]:
        """Every rank, in site order (reads may be collectives): reads this round's tensors; returns
        the two projections from the hidden state on the full-matrix owner (None elsewhere)."""
        self._read = None
        read: dict[str, Optional[torch.Tensor]] = {}
        if self.fused_down is not None:
            whole = self._whole(self.fused_down, gather=self.works)
            if whole is not None and self.works:
                read["q_down"], read["kv_down"] = whole[: self.r_q], whole[self.r_q:]
        else:
            if self.q_down is not None:
                read["q_down"] = self._whole(self.q_down, gather=self.works)
            read["kv_down"] = self._whole(self.kv_down, gather=self.works)
        if self.q_proj is not None:
            # Every TP rank of the full-matrix replica joins the gather; the per-head read is local.
            if self.full_replica and self.tp > 1:
                read["q_proj"], read["q_proj_whole"] = read_and_gather_rows(
                    self.q_proj.read, self.tp_group, f"layer {self.layer_number} linear_q_proj", self.guard)
            else:
                read["q_proj"] = read["q_proj_whole"] = self.q_proj.read()
        else:
            read["q_up"] = self.q_up()
        read["kv_up"] = self.kv_up()
        read["q_norm"] = None if self.q_norm is None else self.q_norm()
        read["kv_norm"] = None if self.kv_norm is None else self.kv_norm()
        self._read = read
        if not self.full_owner:
            return None
        wq = read["q_proj_whole"] if self.q_proj is not None else read["q_down"]
        return FullQK(wq=wq, wk=read["kv_down"])

    def read_heads(self) -> Optional[MLAHeads]:
        """This rank's heads on the layer's per-head replica (None elsewhere); uses read_full's read."""
        read, self._read = self._read, None
        if not self.heads_owner:
            return None
        if read is None:
            raise RuntimeError(f"layer {self.layer_number}: read_heads called without a successful read_full")
        kv_up = read["kv_up"]
        keys = kv_up.reshape(self.np_local, self.d_nope + self.d_v, self.r_kv)[:, : self.d_nope]
        common = dict(kv_down=read["kv_down"], kv_up=keys.reshape(self.np_local * self.d_nope, self.r_kv),
                      kv_norm=read["kv_norm"])
        if self.q_proj is not None:
            weights = MLAWeights(q_proj=read["q_proj"], **common)
        else:
            weights = MLAWeights(q_down=read["q_down"], q_norm=read["q_norm"], q_up=read["q_up"], **common)
        return MLAHeads(weights=weights, d_nope=self.d_nope, d_rope=self.d_rope, num_heads=self.np_local,
                        head_offset=self.tp_rank * self.np_local)

    def budget(self, element_size: int, device: torch.device) -> SnapshotBudget:
        """Elements the snapshot holds on this rank (the down projections counted in each read that
        keeps them; shared copies make the real figure smaller)."""
        d_qk = self.d_nope + self.d_rope
        hidden = int((self.kv_down or self.fused_down or self.q_proj).param.shape[-1])
        down = (self.r_q or 0) * hidden + (self.r_kv + self.d_rope) * hidden
        heads = 0
        if self.heads_owner:
            query = self.np_local * d_qk * (hidden if self.r_q is None else self.r_q)
            heads = down + query + self.np_local * self.d_nope * self.r_kv + (self.r_q or 0) + self.r_kv
        full = 0
        if self.full_owner:
            full = (self.n_h * d_qk * hidden if self.r_q is None else self.r_q * hidden) \
                + (self.r_kv + self.d_rope) * hidden
        return SnapshotBudget(heads_elements=heads, full_elements=full, shared=False,
                              element_size=element_size, device=device)
