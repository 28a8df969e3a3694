"""Read the weights the optimizer updates: FP32 main parameters where megatron-core keeps them.

With BF16 (or FP16) model parameters, megatron-core's mixed-precision optimizers update an FP32
copy (the *main* parameter) and round it into the model parameter after every step. An increment
``dW = W_t - W_{t-delta}`` taken from the BF16 model weights carries that rounding, about
``2^-9 |W|`` per element, as white noise; late in a decaying LR schedule the noise outweighs the
true update and flattens the spectrum the monitors read. So the session reads the main parameter:

* ``Float16OptimizerWithFloat16Params`` (``--bf16`` / ``--fp16``): the full FP32 copy, paired with
  the model parameter in ``float16_groups`` / ``fp32_from_float16_groups`` (what the optimizer
  copies into the model weights after its step). Replicated on every data-parallel rank: no
  communication.
* ``DistributedOptimizer``: each data-parallel rank holds the FP32 main values of one contiguous
  range of every bucket (``_get_model_param_range_map(param)["param"]``), i.e. a 1-D shard of the
  flattened parameter or nothing. The ranges are disjoint and cover the parameter. Once the site
  has said which replicas use the layer and which rows it reads (``reader.configure_use``: the
  Q and K rows of ``linear_qkv``, the replicas doing its per-head or full-matrix work), each rank
  sends the part of its shard that falls on those rows to each using rank (``dist.gather``,
  padded to the largest part), and only the using ranks assemble the parameter (the rows not read
  stay zero); the others get None. The layout of the parts is exchanged once, at the first read
  (one small all-gather). Without ``configure_use`` (a plain reader, e.g. the tools) every rank
  places its shard in a zero FP32 tensor of the parameter's size and the group sums them
  (``x + 0 == x``, exact): twice the bytes of the whole parameter, to every replica.
  Either is a collective on check / snapshot steps only: **every rank of the group must call the
  reader, in the same order** (``reader.collective`` says so); the local part runs under
  ``CollectiveGuard.guarded`` (the guard the session factory passes to :func:`weight_reader`), so
  a local failure raises on every rank instead of hanging.
  ``reader.traffic`` counts the FP32 elements this rank sent and received so far.
  With the precision-aware optimizer (Transformer Engine's FusedAdam holds the master weights)
  the shard comes from the optimizer's own accessor (``_get_main_param_and_optimizer_states``).
* ``ChainedOptimizer``: the member optimizer that owns the parameter.
* ``FP32Optimizer`` and FP32 model parameters in general: the model weight *is* the weight the
  optimizer updates (source ``"model"``, no copy, no communication).

Fallback (source ``"model"``, a notice logged once per reason): no optimizer given, the
parameter not trained by it, an optimizer kind not recognised, or ``--mechmon-weights model``.

Quantized parameter tensors (Transformer Engine ``Float8Tensor`` / ``MXFP8Tensor`` /
``QuantizedTensor``, ``torch.float8_*`` dtypes, torch quantized tensors, integer dtypes, unknown
tensor subclasses) matter only where the model weight is read: they are dequantized through their
documented ``dequantize()`` and otherwise refused at start-up with a ``ValueError`` naming the
layer and the flag. Nothing here imports Transformer Engine; types are detected by feature.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence, get_args

import torch
import torch.distributed as dist

from mechmon_megatron.session.collective_guard import CollectiveGuard
from mechmon_megatron.session.log import mechmon_log

log = mechmon_log(__name__)

Source = Literal["main", "model"]
"""Where a reader's tensor comes from: the optimizer's FP32 main parameter, or the model weight."""

WeightSetting = Literal["main", "model"]
"""``--mechmon-weights``: ``main`` reads FP32 main parameters where the host keeps them (default),
``model`` always reads the model weights (dequantized when quantized)."""

WEIGHTS_FLAG = "--mechmon-weights"
WEIGHT_SETTINGS: tuple[str, ...] = get_args(WeightSetting)
DEFAULT_WEIGHT_SETTING: WeightSetting = "main"

_PLAIN_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def resolve_weight_setting(value: Optional[str] = None) -> WeightSetting:
    """Validate the ``--mechmon-weights`` value (None: the default, ``main``)."""
    if value is None:
        return DEFAULT_WEIGHT_SETTING
    text = str(value).strip().lower()
    if text not in WEIGHT_SETTINGS:
        raise ValueError(f"{WEIGHTS_FLAG} must be one of {list(WEIGHT_SETTINGS)}, got {value!r}.")
    return text  # type: ignore[return-value]


class WeightReader:
    """A zero-argument callable returning one parameter's weight (FP32 where main, its shape).

    Attributes: ``source`` ("main" / "model"); ``collective`` (True: every rank of ``group`` must
    call it on the same steps, in the same order); ``group``; ``reason`` (why this source);
    ``layer`` (the name used in messages). The returned tensor may alias live optimizer or model
    storage: copy it before the next optimizer step if it must be kept.
    """

    def __init__(
        self,
        read: Callable[[], torch.Tensor],
        *,
        source: Source,
        reason: str,
        layer: str,
        collective: bool = False,
        group: Any = None,
        configure_use: Optional[Callable[[bool, Optional[torch.Tensor]], None]] = None,
    ) -> None:
        self._read = read
        self.source: Source = source
        self.reason = reason
        self.layer = layer
        self.collective = collective
        self.group = group
        self._configure_use = configure_use
        self.traffic = {"sent": 0, "received": 0}
        """FP32 elements this rank sent to / received from its peers in the reads so far."""

    def configure_use(self, uses: bool, rows: Optional[torch.Tensor] = None) -> None:
        """Say (at start-up, on every rank of the group) whether this rank uses the weight and
        which rows of it (int64 row indices; None: all). A reader that is not a collective ignores
        it; a collective one then returns None on the ranks that do not use it."""
        if self._configure_use is not None:
            self._configure_use(uses, rows)

    def __call__(self) -> Optional[torch.Tensor]:
        return self._read()

    def __repr__(self) -> str:
        return f"WeightReader(layer={self.layer!r}, source={self.source!r}, collective={self.collective})"


# ---------------------------------------------------------------------------- quantized tensors
def _own_dequantize(tensor: torch.Tensor) -> Optional[Callable[[], torch.Tensor]]:
    """The tensor's documented dequantization, if it has one (TE QuantizedTensor, torch qint)."""
    if getattr(tensor, "is_quantized", False):  # torch's own quantized tensors
        return tensor.dequantize
    method = getattr(type(tensor), "dequantize", None)
    if method is not None and method is not torch.Tensor.dequantize:  # a subclass's own method
        return tensor.dequantize
    return None


def quantization_of(tensor: torch.Tensor) -> Optional[str]:
    """None for a plain float tensor; else a description (class and dtype) of how it is stored.

    Detected by feature: a tensor subclass other than ``nn.Parameter`` (Transformer Engine's
    Float8Tensor reports its nominal high-precision dtype, so the class is what gives it away),
    torch's quantized tensors, FP8 / FP4 dtypes, and integer or boolean dtypes.
    """
    cls = type(tensor)
    plain_class = cls in (torch.Tensor, torch.nn.Parameter)
    if plain_class and not getattr(tensor, "is_quantized", False) and tensor.dtype in _PLAIN_FLOATS:
        return None
    return f"{cls.__module__}.{cls.__qualname__} (dtype {tensor.dtype})"


def model_weight_reader(param: torch.Tensor, layer: str, reason: str) -> WeightReader:
    """Read the model weight itself: as is (its own dtype, not copied) when it is a plain float
    tensor, dequantized to FP32 through its documented ``dequantize()``, or refused."""
    kind = quantization_of(param)
    if kind is None:
        return WeightReader(param.detach, source="model", reason=reason, layer=layer)
    dequantize = _own_dequantize(param)
    if dequantize is None:
        raise ValueError(
            f"mechmon: layer {layer}: the weight is stored as {kind}, a quantized or unknown tensor type "
            f"with no documented dequantization (.dequantize()), and the model weight is what would be read "
            f"({reason}); mechmon cannot read it. Read the "
            f"optimizer's FP32 main parameters instead ({WEIGHTS_FLAG} main, with the megatron-core "
            "optimizer given to the session), or leave the attention monitors out (--mechmon-monitors)."
        )

    def read() -> torch.Tensor:
        return dequantize().detach().float()

    return WeightReader(read, source="model", reason=f"{reason}; dequantized from {kind}", layer=layer)


# ---------------------------------------------------------------------------- optimizer kinds
def _optimizer_classes() -> dict[str, type]:
    """megatron-core's optimizer classes that this module knows, by role (lazy import)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer

    return {
        "chained": ChainedOptimizer,
        "distributed": DistributedOptimizer,
        "float16": Float16OptimizerWithFloat16Params,
        "fp32": FP32Optimizer,
    }


def _members(optimizer: Any, classes: dict[str, type]) -> list[Any]:
    """Flatten a plain ChainedOptimizer (subclasses, e.g. a layer-wise one, stay opaque)."""
    members = getattr(optimizer, "chained_optimizers", None)
    if type(optimizer) is classes["chained"] and members is not None:
        out: list[Any] = []
        for member in members:
            out.extend(_members(member, classes))
        return out
    return [optimizer]


def _float16_reader(optimizer: Any, param: torch.Tensor, layer: str) -> Optional[WeightReader]:
    for g, group in enumerate(getattr(optimizer, "float16_groups", ())):  # absent on a stub optimizer
        for i, model_param in enumerate(group):
            if model_param is param:

                def read(_g: int = g, _i: int = i) -> torch.Tensor:
                    return _paired_main(optimizer, _g, _i, param).detach()

                return WeightReader(
                    read,
                    source="main",
                    reason=f"FP32 main parameter of {type(optimizer).__name__}",
                    layer=layer,
                )
    return None


def _paired_main(optimizer: Any, g: int, i: int, param: torch.Tensor) -> torch.Tensor:
    """The FP32 copy the optimizer writes into ``param`` (looked up at read time)."""
    if optimizer.float16_groups[g][i] is not param:
        raise RuntimeError("mechmon: the optimizer's parameter groups changed after the session was built")
    main = optimizer.fp32_from_float16_groups[g][i]
    if main.shape != param.shape:
        raise RuntimeError(f"mechmon: main parameter shape {tuple(main.shape)} != model {tuple(param.shape)}")
    return main


def _in_buffers(optimizer: Any, param: torch.Tensor) -> bool:
    """True when ``param`` lives in one of the distributed optimizer's buffers (on every DP rank,
    whether or not this rank holds part of its main values)."""
    return any(param in getattr(buffer, "param_index_map", {}) for buffer in getattr(optimizer, "buffers", ()))


def _local_main_shard(optimizer: Any, param: torch.Tensor) -> Optional[tuple[int, torch.Tensor]]:
    """(offset in the flattened parameter, FP32 main values) held by this DP rank, or None."""
    if param not in getattr(optimizer, "model_param_gbuf_map", {}):
        return None
    span = optimizer._get_model_param_range_map(param)["param"]
    if getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        shard = optimizer._get_main_param_and_optimizer_states(param)["param"]
    else:
        shard = None
        for model_group, main_group in zip(optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                if model_param is param:
                    shard = main_param
        if shard is None:
            raise RuntimeError("mechmon: parameter missing from the distributed optimizer's main groups")
    if shard.numel() != span.size:
        raise RuntimeError(f"mechmon: main shard has {shard.numel()} values, its range {span.size}")
    return span.start, shard.detach().reshape(-1).float()


@dataclass
class _GatherPlan:
    """Who sends what to whom for one parameter: fixed by the layout, built at the first read."""

    users: list[int]
    """Ranks of the group (group-local) that use the weight and receive it."""
    pad: int
    """Elements each rank sends per using rank (the largest part; shorter parts are zero-padded)."""
    counts: list[int]
    """Elements of each rank's part."""
    take: Optional[torch.Tensor]
    """This rank's part: positions in its own main shard (None: no shard)."""
    targets: list[torch.Tensor]
    """Per rank of the group, where its part lands in the flattened parameter (users only)."""


def _part_positions(start: int, size: int, hidden: int, row_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Positions (0-based in the shard) of the shard's elements on read rows; shard = flat
    elements ``[start, start + size)`` of a ``[rows, hidden]`` parameter."""
    positions = torch.arange(size, dtype=torch.int64)
    if row_mask is None:
        return positions
    return positions[row_mask[(start + positions) // hidden]]


def _distributed_reader(optimizer: Any, param: torch.Tensor, layer: str, dp_group: Any,
                        guard: CollectiveGuard) -> WeightReader:
    group = getattr(optimizer, "data_parallel_group", None)
    if group is None:
        group = dp_group
    guard.declare(group)  # mechmon's own copy of it is made when the session starts
    numel, shape = param.numel(), param.shape
    hidden = int(shape[-1]) if len(shape) > 1 else 1
    use: dict[str, Any] = {"configured": False, "uses": True, "row_mask": None, "plan": None}
    what = f"the FP32 main-parameter gather of {layer}"

    def distributed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    def configure(uses: bool, rows: Optional[torch.Tensor]) -> None:
        mask = None
        if rows is not None:
            mask = torch.zeros(int(shape[0]), dtype=torch.bool)
            mask[rows.reshape(-1).cpu()] = True
        use.update(configured=True, uses=bool(uses), row_mask=mask, plan=None)

    # ------------------------------------------------ all-reduce (no configure_use: every rank gets it)
    def local_full() -> torch.Tensor:
        full = torch.zeros(numel, dtype=torch.float32, device=param.device)
        held = _local_main_shard(optimizer, param)
        if held is not None:
            start, shard = held
            full[start : start + shard.numel()] = shard
        return full

    def all_reduce(full: torch.Tensor) -> torch.Tensor:
        if distributed():
            size = dist.get_world_size(group)
            guard.all_reduce(full, group, what)  # disjoint shards: exact
            ring = 2 * (size - 1) * numel // size  # what a ring all-reduce moves each way per rank
            reader.traffic["sent"] += ring
            reader.traffic["received"] += ring
        return full.view(shape)

    # ------------------------------------------------ gather to the using ranks, read rows only
    def plan() -> _GatherPlan:
        if use["plan"] is not None:
            return use["plan"]

        def describe() -> tuple[torch.Tensor, Optional[tuple[int, int]]]:
            held = _local_main_shard(optimizer, param)
            span = None if held is None else (held[0], held[1].numel())
            start, size = span or (0, 0)
            mine = torch.tensor([1 if use["uses"] else 0, start, size, 1 if span else 0], dtype=torch.int64,
                                device=param.device)
            return mine, span

        def exchange(prepared: tuple[torch.Tensor, Optional[tuple[int, int]]]):
            mine, span = prepared
            parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            guard.all_gather(parts, mine, group, f"{what} (layout)")
            return [tuple(int(v) for v in p.cpu().tolist()) for p in parts], span

        rows, span = guard.guarded(describe, exchange, group, f"{what} (layout)")
        mask = use["row_mask"]
        positions = [_part_positions(start, size, hidden, mask) if held else torch.zeros(0, dtype=torch.int64)
                     for _, start, size, held in rows]
        me = dist.get_rank(group)
        built = _GatherPlan(
            users=[r for r, (uses, _, _, _) in enumerate(rows) if uses],
            pad=max(int(p.numel()) for p in positions),
            counts=[int(p.numel()) for p in positions],
            take=positions[me].to(param.device) if span is not None else None,
            targets=[(start + p).to(param.device) for (_, start, _, _), p in zip(rows, positions)]
            if use["uses"] else [],
        )
        use["plan"] = built
        return built

    def local_part() -> tuple[_GatherPlan, torch.Tensor]:
        layout = plan()
        part = torch.zeros(layout.pad, dtype=torch.float32, device=param.device)
        if layout.take is not None and layout.take.numel():
            held = _local_main_shard(optimizer, param)
            assert held is not None  # the layout said this rank holds a shard
            part[: layout.take.numel()] = held[1].index_select(0, layout.take)
        return layout, part

    def gather(prepared: tuple[_GatherPlan, torch.Tensor]) -> Optional[torch.Tensor]:
        layout, part = prepared
        me, size = dist.get_rank(group), dist.get_world_size(group)
        received: Optional[list[torch.Tensor]] = None
        for user in layout.users:
            inbox = guard.gather(part, user, group, what)  # the list on ``user`` only
            if user == me:
                received = inbox
                reader.traffic["received"] += (size - 1) * layout.pad
            else:
                reader.traffic["sent"] += layout.pad
        if received is None:
            return None  # this rank does not use the weight
        full = torch.zeros(numel, dtype=torch.float32, device=param.device)
        for target, count, values in zip(layout.targets, layout.counts, received):
            full[target] = values[:count]
        return full.view(shape)

    def read() -> Optional[torch.Tensor]:
        if not distributed():
            return guard.guarded(local_full, all_reduce, group, what=what)
        if not use["configured"]:
            return guard.guarded(local_full, all_reduce, group, what=what)
        return guard.guarded(local_part, gather, group, what=what)

    reader = WeightReader(
        read,
        source="main",
        reason="FP32 main parameter shards of the DistributedOptimizer, gathered over its data-parallel group",
        layer=layer,
        collective=True,
        group=group,
        configure_use=configure,
    )
    return reader


def _main_reader(optimizer: Any, param: torch.Tensor, layer: str, dp_group: Any,
                 guard: CollectiveGuard) -> tuple[Optional[WeightReader], str]:
    """A main-parameter reader, or (None, why not)."""
    classes = _optimizer_classes()
    unknown: list[str] = []
    for member in _members(optimizer, classes):
        if isinstance(member, classes["distributed"]):
            if _in_buffers(member, param):
                return _distributed_reader(member, param, layer, dp_group, guard), ""
        elif isinstance(member, classes["float16"]):
            reader = _float16_reader(member, param, layer)
            if reader is not None:
                return reader, ""
        elif not isinstance(member, classes["fp32"]):
            unknown.append(type(member).__name__)
    if unknown:
        return None, f"optimizer kind {', '.join(sorted(set(unknown)))} not recognised"
    return None, "the parameter is not among the optimizer's 16-bit parameters"


# ---------------------------------------------------------------------------- resolver
def weight_reader(
    param: torch.Tensor,
    optimizer: Any,
    dp_group: Any = None,
    *,
    layer: str = "",
    setting: WeightSetting = DEFAULT_WEIGHT_SETTING,
    notices: Optional[set[str]] = None,
    guard: CollectiveGuard,
) -> tuple[WeightReader, Source]:
    """Resolve how to read ``param`` (e.g. a ``linear_qkv.weight`` TP shard): ``(reader, source)``.

    Call on every rank that will call the reader, with the same arguments, at start-up: the
    result depends only on the layout, never on which data-parallel rank holds which shard, so
    all ranks of a group agree on ``reader.collective``. ``optimizer``: the megatron-core optimizer
    (any kind; None = none known). ``dp_group``: the data-parallel group, used only when the
    distributed optimizer does not name its own. ``layer`` names the parameter in messages.
    A fallback to the model weight is logged once per reason (``notices`` collects the reasons
    already logged; pass one set for all layers). ``guard``: the collective guard a collective
    reader runs through (the process's, from the host). Raises ValueError for a quantized weight
    that must be read and cannot be dequantized.
    """
    setting = resolve_weight_setting(setting)
    layer = layer or "<unnamed>"
    if setting == "model":
        reason = f"{WEIGHTS_FLAG} model"
    elif quantization_of(param) is None and param.dtype in (torch.float32, torch.float64):
        reason = "FP32 parameters: the model weight is the weight the optimizer updates"
    elif optimizer is None:
        reason = "no optimizer given to the session"
    else:
        reader, reason = _main_reader(optimizer, param, layer, dp_group, guard)
        if reader is not None:
            return reader, "main"
    reader = model_weight_reader(param, layer, reason)
    _notice_once(reader.reason, setting, notices, dp_group)
    return reader, "model"


def weight_readers(
    named_params: Sequence[tuple[str, torch.Tensor]],
    optimizer: Any,
    dp_group: Any = None,
    setting: Optional[str] = None,
    *,
    guard: CollectiveGuard,
) -> list[tuple[WeightReader, Source]]:
    """:func:`weight_reader` for each ``(layer name, parameter)``, each notice logged once."""
    notices: set[str] = set()
    resolved = resolve_weight_setting(setting)
    return [
        weight_reader(param, optimizer, dp_group, layer=name, setting=resolved, notices=notices, guard=guard)
        for name, param in named_params
    ]


def _notice_once(reason: str, setting: str, notices: Optional[set[str]], dp_group: Any) -> None:
    if notices is not None:
        if reason in notices:
            return
        notices.add(reason)
    if dist.is_available() and dist.is_initialized() and dist.get_rank(dp_group) > 0:
        return  # one data-parallel replica speaks for all
    expected = setting == "model" or reason.startswith("FP32 parameters")
    log.log(logging.INFO if expected else logging.WARNING,
            "reading the model weights, not FP32 main parameters: %s", reason)
