"""Turn megatron-core modules into the session's sites, handling TP / DP / EP / SP layouts.

Who computes what (so every value is produced exactly once, and the work is spread over every
rank that holds a copy of the layer):
* Attention: every rank lists every attention layer of its pipeline stage (reads may be
  collectives: the TP gather, and the data-parallel gather of sharded FP32 main parameters).
  The per-head work of layer L runs on data-parallel replica ``(L - 1) % dp`` (context parallel
  included), where each TP rank reports its own ``np / tp`` query heads -- sliced locally when it
  holds whole query groups (ng >= tp), otherwise from the TP-gathered weight (ng < tp). The
  full-matrix dW of layer L runs on one rank of the DP x TP grid: index ``j = (L - 1) % (dp * tp)``,
  i.e. replica ``j // tp``, TP rank ``j % tp``, from the TP-gathered weight.
* Every collective runs through the process's collective guard (``session/collective_guard.py``,
  passed in by the session factory) on mechmon's own copy of its group (bounded by
  ``--mechmon-collective-timeout``): a rank whose own part fails makes every rank of the group
  raise instead of leaving them waiting in the collective, and a failure inside the collective
  costs its peers at most the timeout.
* Routers: every rank lists them; token statistics (entropy of the logits, load from the router's
  own routing map) are summed over the data-parallel group (plus the TP group under sequence
  parallelism, where TP ranks route different tokens); one rank per pipeline stage (DP rank 0,
  TP rank 0) reports.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mechmon_megatron.adapters.megatron_core.discovery import FoundAttention, FoundRouter, LeftOut, router_settings
from mechmon_megatron.adapters.megatron_core.mla_sites import MLAReader
from mechmon_megatron.adapters.megatron_core.norms import GammaReader, NormSpec, UnsupportedLayout, norm_spec
from mechmon_megatron.adapters.megatron_core.tp_gather import group_rank, group_size, read_and_gather_rows
from mechmon_megatron.detect.phase_moments import LATENT_ATTENTION
from mechmon_megatron.monitors.norm_fold import NormFold
from mechmon_megatron.monitors.router import check_score_function
from mechmon_megatron.session.collective_guard import CollectiveGuard
from mechmon_megatron.session.host import AttentionSite, FullQK, QKWeights, RouterSite, SnapshotBudget
from mechmon_megatron.session.host_settings import in_backward
from mechmon_megatron.session.log import mechmon_log
from mechmon_megatron.session.qkv_layout import qkv_row_indices, split_qk
from mechmon_megatron.session.router_check import NON_SOFTMAX_FLOOR_NOTICE, entropy_floor_applies

log = mechmon_log(__name__)

WeightSource = Callable[[torch.nn.Parameter], Callable[[], torch.Tensor]]
"""Given a ``linear_qkv.weight``, a reader of the weights to monitor (e.g. FP32 main parameters).
The reader may be a collective over the data-parallel group: every rank calls it, in site order."""


class _AttentionReader:
    """Reads per-head and full Q/K weights of one SelfAttention on one rank (its gathers through ``guard``)."""

    def __init__(self, found: FoundAttention, tp_group: Any, full_matrix: bool, dp_rank: int, dp: int,
                 weight_source: Optional[WeightSource], guard: CollectiveGuard) -> None:
        module = found.module
        self.full_matrix = full_matrix
        cfg = module.config
        self.layer_number = found.layer_number
        self.weight = module.linear_qkv.weight
        self.read_weight: Callable[[], torch.Tensor] = (
            weight_source(self.weight) if weight_source is not None else (lambda: self.weight.detach())
        )
        self.tp_group = tp_group
        self.guard = guard
        guard.declare(tp_group)  # mechmon's own copy is made when the session starts
        self.tp = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.np = cfg.num_attention_heads
        self.ng = cfg.num_query_groups or cfg.num_attention_heads
        self.hn = module.hidden_size_per_attention_head
        self.gate = bool(getattr(cfg, "attention_output_gate", False))
        self.np_local = self.np // self.tp
        index = self.layer_number - 1
        self.heads_owner = index % dp == dp_rank
        full_replica = full_matrix and (index % (dp * self.tp)) // self.tp == dp_rank
        self.full_owner = full_replica and index % (dp * self.tp) % self.tp == self.tp_rank
        # The TP group of a replica gathers when that replica does full-matrix work, or per-head
        # work on a layer whose query groups span ranks (ng < tp). All its TP ranks agree.
        self.gathers = self.tp > 1 and (full_replica or (self.heads_owner and self.ng < self.tp))
        # A collective reader (sharded FP32 main parameters) then sends this layer's Q and K rows
        # to the replicas that use it only (main_params.py); the others read nothing.
        configure = getattr(self.read_weight, "configure_use", None)
        if callable(configure):
            configure(self.heads_owner or full_replica, self._qk_rows())
        self._local: Optional[torch.Tensor] = None
        self._gathered: Optional[torch.Tensor] = None
        self._split: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        """read_full's Q/K split when it is also this rank's per-head read (TP 1): one copy, shared."""
        # QK-norm (qk_layernorm): its gamma, folded into the per-head rows by the check.
        self._norm_readers = tuple(
            (None if spec is None else GammaReader(spec, weight_source, self.heads_owner), spec)
            for spec in (norm_spec(getattr(module, "q_layernorm", None), cfg, "q_layernorm", self.hn),
                         norm_spec(getattr(module, "k_layernorm", None), cfg, "k_layernorm", self.hn)))
        self._norms: tuple[Optional[NormFold], Optional[NormFold]] = (None, None)

    def _qk_rows(self) -> Optional[torch.Tensor]:
        """Rows of this rank's ``linear_qkv`` shard that hold Q and K (None: all, when a query
        group spans TP ranks and the shard is not whole groups)."""
        if self.ng < self.tp:
            return None
        q_rows, k_rows = qkv_row_indices(self.np_local, self.ng // self.tp, self.hn, self.gate)
        return torch.cat([q_rows.reshape(-1), k_rows.reshape(-1)])

    def budget(self, element_size: int) -> SnapshotBudget:
        hidden = int(self.weight.shape[-1])
        groups_local = self.ng // self.tp if self.ng >= self.tp else 1
        heads = (self.np_local + groups_local) * self.hn * hidden if self.heads_owner else 0
        full = (self.np + self.ng) * self.hn * hidden if self.full_owner else 0
        return SnapshotBudget(heads_elements=heads, full_elements=full, shared=self.tp == 1,
                              element_size=element_size, device=self.weight.device)

    def read_full(self) -> Optional[FullQK]:
        """Full Q/K of the layer on its owner (None elsewhere). Collective: every rank calls it first."""
        self._local = self._gathered = self._split = None
        # read_weight may itself be a data-parallel collective (sharded FP32 main parameters).
        if self.gathers:
            local, self._gathered = read_and_gather_rows(self.read_weight, self.tp_group,
                                                          f"layer {self.layer_number} Q/K weights", self.guard)
        else:
            local = self.read_weight()
        self._local = local
        self._norms = tuple(self._read_norm(reader, spec) for reader, spec in self._norm_readers)
        if not self.full_owner:
            return None
        full = self._gathered if self.tp > 1 else local
        assert full is not None
        wq, wk = split_qk(full, self.np, self.ng, self.hn, self.gate)
        if self.tp == 1:
            self._split = (wq, wk)  # the per-head read of this rank is the same rows: views, not a copy
        return FullQK(wq=wq.reshape(self.np * self.hn, -1), wk=wk.reshape(self.ng * self.hn, -1))

    @staticmethod
    def _read_norm(reader: Optional[GammaReader], spec: Optional[NormSpec]) -> Optional[NormFold]:
        if reader is None or spec is None:
            return None
        return NormFold(gamma=reader(), centres=spec.centres)

    def read_heads(self) -> Optional[QKWeights]:
        """This rank's heads on the layer's per-head replica (None elsewhere); uses read_full's read."""
        local, gathered, split = self._local, self._gathered, self._split
        (q_norm, k_norm), self._norms = self._norms, (None, None)
        self._local = self._gathered = self._split = None
        if not self.heads_owner:
            return None
        if local is None:
            raise RuntimeError(f"layer {self.layer_number}: read_heads called without a successful read_full")
        norms = dict(q_norm=q_norm, k_norm=k_norm)
        if split is not None:
            return QKWeights(wq=split[0], wk=split[1], head_offset=0, **norms)
        offset = self.tp_rank * self.np_local
        if self.ng >= self.tp:
            wq, wk = split_qk(local, self.np_local, self.ng // self.tp, self.hn, self.gate)
            return QKWeights(wq=wq, wk=wk, head_offset=offset, **norms)
        # ng < tp: a query group spans ranks; read_full gathered the weight this round.
        assert gathered is not None
        wq_all, wk_all = split_qk(gathered, self.np, self.ng, self.hn, self.gate)
        group = offset // (self.np // self.ng)  # np/tp heads of one rank share one group
        return QKWeights(wq=wq_all[offset : offset + self.np_local], wk=wk_all[group : group + 1], head_offset=offset,
                         **norms)


def attention_sites(
    found: list[FoundAttention],
    tp_group: Any,
    full_matrix: bool,
    dp_rank: int = 0,
    dp: int = 1,
    weight_source: Optional[WeightSource] = None,
    element_size: Optional[int] = None,
    left_out: Optional[list[LeftOut]] = None,
    *,
    guard: CollectiveGuard,
) -> list[AttentionSite]:
    """One site per attention layer of this rank's stage; see the module docstring for who does what
    (``mla_sites.py`` for multi-head latent attention). Their collectives run through ``guard``.

    ``weight_source``: what to read (default: the model weight); ``element_size``: bytes per
    element of that read (default: 4 for FP32 main parameters, else the model weight's), for the
    snapshot budget. A layer the monitors cannot decompose (:class:`UnsupportedLayout`: absorbed
    MLA, a shape that does not reconcile with the config, an unknown norm) gets no site and is
    appended to ``left_out`` with the reason; the decision depends on shapes and types only, so
    every rank decides alike.
    """
    sites = []
    for item in found:
        group = getattr(item.module, "tp_group", None) or tp_group
        try:
            if item.kind == "mla":
                sites.append(_mla_site(item, group, full_matrix, dp_rank, dp, weight_source, element_size, guard))
                continue
            reader = _AttentionReader(item, group, full_matrix, dp_rank, dp, weight_source, guard)
        except UnsupportedLayout as exc:
            if left_out is not None:
                left_out.append(LeftOut(item.layer_number, item.name, str(exc)))
            continue
        main = getattr(reader.read_weight, "source", "model") == "main"
        size = element_size if element_size is not None else (4 if main else reader.weight.element_size())
        sites.append(AttentionSite(item.layer_number, reader.read_heads, reader.read_full, item.name,
                                   snapshot_budget=reader.budget(size),
                                   reports=reader.heads_owner or reader.full_owner))
    return sites


def _mla_site(item: FoundAttention, group: Any, full_matrix: bool, dp_rank: int, dp: int,
              weight_source: Optional[WeightSource], element_size: Optional[int],
              guard: CollectiveGuard) -> AttentionSite:
    tp, tp_rank = group_size(group), group_rank(group)
    reader = MLAReader(item, group, full_matrix, dp_rank, dp, weight_source, tp, tp_rank, guard)
    param = item.module.linear_kv_up_proj.weight
    main = getattr(reader.kv_up, "source", "model") == "main"
    size = element_size if element_size is not None else (4 if main else param.element_size())
    return AttentionSite(item.layer_number, reader.read_heads, reader.read_full, item.name,
                         snapshot_budget=reader.budget(size, param.device),
                         reports=reader.heads_owner or reader.full_owner, attention=LATENT_ATTENTION)


def router_sites(
    found: list[FoundRouter], reduce_group: Any, reports: bool, capture_enabled: Callable[[], bool],
    weight_source: Optional[Callable[[Any], Callable[[], torch.Tensor]]] = None, *, guard: CollectiveGuard,
) -> list[RouterSite]:
    """Router sites plus a capture wrapper around each router's ``routing`` (logits and routing map).

    The site knows the router's score function (the routing entropy's definition) and whether it
    drops tokens; both are read from the router (``discovery.router_settings``). An unknown score
    function fails here, at start-up, naming it. Routers without softmax scores have no
    routing-entropy floor: the reporting rank logs that once (``NON_SOFTMAX_FLOOR_NOTICE``).
    ``weight_source(router)``: how the reporting rank reads the router weight (default: the model
    weight; the session factory passes the FP32 main parameter under ``--mechmon-weights main``).
    The all-reduces of the token statistics run through ``guard``.
    """
    sites = []
    if found:
        guard.declare(reduce_group)
    for item in found:
        module = item.module
        settings = router_settings(module)

        def reduce_sum(vector: torch.Tensor, _group=reduce_group, _device=module.weight.device,
                       _layer=item.layer_number) -> torch.Tensor:
            if not dist.is_initialized() or group_size(_group) == 1:
                return vector.cpu()
            # fp64 for exact integer counts; NCCL needs the tensor on the module's device.
            work = vector.to(device=_device, dtype=torch.float64)
            guard.all_reduce(work, _group, f"the router all-reduce of layer {_layer}")
            return work.cpu()

        site = RouterSite(
            layer_number=item.layer_number,
            num_experts=int(module.weight.shape[0]),
            topk=int(module.topk),
            weight=weight_source(module) if weight_source is not None else (lambda _m=module: _m.weight),
            reduce_sum=reduce_sum,
            reports=reports,
            name=item.name,
            score_function=check_score_function(settings.score_function),
            drops_tokens=settings.drops_tokens,
        )
        install_routing_capture(module, site, capture_enabled, pad_to_capacity=settings.pad_to_capacity)
        sites.append(site)
    if reports:
        _notice_non_softmax(sites)
    return sites


def _notice_non_softmax(sites: list[RouterSite]) -> None:
    by_score: dict[str, list[int]] = {}
    for site in sites:
        if not entropy_floor_applies(site):
            by_score.setdefault(site.score_function, []).append(site.layer_number)
    for score, layers in sorted(by_score.items()):
        log.warning(NON_SOFTMAX_FLOOR_NOTICE.format(score=score, layers=", ".join(map(str, layers))))


def install_routing_capture(
    router: Any, site: RouterSite, capture_enabled: Callable[[], bool], pad_to_capacity: bool = False
) -> None:
    """Wrap ``router.routing`` (instance attribute) to summarise its input and output on check steps.

    megatron-core's ``TopKRouter.forward`` computes the logits (``gating``) and calls
    ``self.routing(logits, padding_mask=...)``, which returns ``(probs, routing_map)``: the
    sparse top-k gate values and the bool ``[tokens, E]`` assignment after the score function,
    an expert bias, group-limited selection and capacity dropping. The full score distribution
    is never materialised, so the site computes the entropy from the logits ``routing`` received;
    the load comes from the routing map. Both are reduced at once to a small summary
    (``RouterSite.capture``: no logits kept, no host sync). With
    ``moe_pad_expert_input_to_capacity`` the map also marks the padding slots (zero gate), which
    are left out of the load: ``routing_map & (probs != 0)``. A ``routing`` whose output is not
    ``(probs, bool routing_map)`` (another megatron-core release) is recorded as the site's
    capture error, which the check reports. On other steps the wrapper costs one boolean test.
    Under activation recompute the router runs again inside the backward pass: that second run
    is not captured (``host_settings.in_backward``), so every token counts once.
    """
    if getattr(router, "_mechmon_capture", False):
        raise RuntimeError(f"router {site.name} already has a mechmon capture hook (attach the session once)")
    original = router.routing

    def routing(logits: torch.Tensor, *args, **kwargs):
        out = original(logits, *args, **kwargs)
        # Activation recompute re-runs the router inside the backward: its tokens count once,
        # in the forward (session/host_settings.py).
        if capture_enabled() and not in_backward():
            _capture_routing(site, logits, out, pad_to_capacity)
        return out

    router.routing = routing
    router._mechmon_capture = True


def _capture_routing(site: RouterSite, logits: torch.Tensor, out: Any, pad_to_capacity: bool) -> None:
    """``site.capture(logits, routing_map)`` from ``routing``'s output; never raises."""
    try:
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor)
                and out[1].dtype == torch.bool):
            raise TypeError(f"router.routing returned {type(out).__name__}, expected (probs, bool routing_map); "
                            "this megatron-core release routes differently")
        probs, routing_map = out
        if pad_to_capacity:
            routing_map = routing_map & (probs.detach() != 0)
    except Exception as exc:  # noqa: BLE001 -- never kill the training forward; the check counts it
        site.capture_error = site.capture_error or exc
        return
    site.capture(logits, routing_map)
