"""The planner's report: per-rank snapshot memory, FLOPs and time per check, overhead share.

``build_report(shape, layout, options)`` returns one JSON-ready dict (keys documented in
docs/PERFORMANCE.md, "Frontier shapes: mechmon-plan"); ``format_table(report)`` renders it for a
terminal. Every rank's work is counted (``work.rank_classes``); the figures reported "per rank"
are those of the most loaded rank (the check ends in a collective, so the slowest rank sets the
job's pause), each with the rank it comes from.
"""

from __future__ import annotations

import datetime
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, Optional

import torch

from mechmon_megatron.plan import measure
from mechmon_megatron.plan.comm import check_comm_bytes
from mechmon_megatron.plan.estimate import GPUS, GpuSpec, estimated_step_time_s, step_flops
from mechmon_megatron.plan.flops import (
    Cost,
    full_cost,
    heads_cost,
    mla_heads_cost,
    router_stats_cost,
    router_weight_cost,
)
from mechmon_megatron.plan.shapes import ModelShape, ParallelLayout, PlanInputError, validate
from mechmon_megatron.plan.work import (
    RankClass,
    UnitShapes,
    micro_batches_per_step,
    mla_snapshot_elements,
    rank_classes,
    router_tokens_per_micro_batch,
    unit_shapes,
)
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.rollback_reach import MEASURED_LAG_CHECKS, change_point_lag, reach

TARGET_SHARE = 0.01
"""The overhead target: the check, amortised over the interval, at most 1 % of the step time."""
_DEFAULTS = MechmonConfig()
WEIGHT_BYTES = {"main": 4, "model": 2}
WEIGHT_DTYPES = {"main": torch.float32, "model": torch.bfloat16}
COMPONENTS = ("attn_heads", "attn_full", "tp_gather", "main_param_gather", "snapshot_copy", "router_stats",
              "router_allreduce", "router_weights")


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What the planner assumes besides shape and layout (defaults: the session's config)."""

    interval: int = _DEFAULTS.interval
    delta: int = _DEFAULTS.delta
    weights: Literal["main", "model"] = "main"
    """Snapshot dtype: FP32 main parameters (default) or the BF16 model weights (fallback)."""
    device: str = "cpu"
    measure: bool = True
    repeats: int = 3
    step_time_s: Optional[float] = None
    mfu: float = 0.4
    gpu: str = "h100"
    qk_method: str = _DEFAULTS.qk_method
    full_matrix_method: str = _DEFAULTS.full_matrix_method
    full_matrix_rank: int = _DEFAULTS.full_matrix_rank
    wq_norm_power_iters: int = _DEFAULTS.wq_norm_power_iters
    full_matrix_dw: bool = _DEFAULTS.full_matrix_dw
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer shards the FP32 main parameters over DP: with
    ``weights="main"`` the Q and K rows of each layer's TP-local ``linear_qkv`` weight (FP32) are
    gathered over the data-parallel group to each replica that uses the layer (its per-head
    replica, and its full-matrix replica), on check and snapshot steps
    (``adapters/megatron_core/main_params.py``: one guarded ``gather`` per using replica). With MLA
    the gathered tensors are those of the rank's per-head snapshot (``work.mla_snapshot_elements``),
    also for the full-matrix replica, which needs only the down projections among them (an upper
    bound)."""
    router_bins: int = _DEFAULTS.router_entropy_bins
    alpha: float = _DEFAULTS.alpha
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.interval < 1:
            raise PlanInputError("--interval", f"must be >= 1, got {self.interval}")
        if self.delta < 1:
            raise PlanInputError("--delta", f"must be >= 1, got {self.delta}")
        if self.repeats < 0:
            raise PlanInputError("--repeats", f"must be >= 0, got {self.repeats}")
        if self.step_time_s is not None and not self.step_time_s > 0:
            raise PlanInputError("--step-time-s", f"must be > 0, got {self.step_time_s}")
        if self.full_matrix_rank < 1:
            raise PlanInputError("--full-matrix-rank", f"must be >= 1, got {self.full_matrix_rank}")
        if self.wq_norm_power_iters < 0:
            raise PlanInputError("--wq-norm-power-iters", f"must be >= 0, got {self.wq_norm_power_iters}")
        if not 0 < self.mfu <= 1:
            raise PlanInputError("--mfu", f"must be in (0, 1], got {self.mfu}")
        if self.gpu not in GPUS:
            raise PlanInputError("--reference-gpu", f"must be one of {sorted(GPUS)}, got {self.gpu!r}")
        if self.weights not in WEIGHT_BYTES:
            raise PlanInputError("--weights", f"must be main or model, got {self.weights!r}")
        if self.device not in ("cpu", "cuda"):
            raise PlanInputError("--device", f"must be cpu or cuda, got {self.device!r}")
        if self.measure and self.device == "cuda" and not torch.cuda.is_available():
            raise PlanInputError("--device", "cuda was asked for but torch sees no CUDA device; use --device cpu "
                                             "or --no-measure")


@dataclass
class _Component:
    unit_time_s: float
    units: float
    label: Literal["measured", "estimated"]
    measured: Optional[str]
    scaled: str

    @property
    def time_s(self) -> float:
        return self.unit_time_s * self.units

    def as_dict(self) -> dict:
        return {"time_s": self.time_s, **asdict(self)}


class _Units:
    """Unit costs, unit times (measured or estimated) and per-rank totals of one plan."""

    def __init__(self, shape: ModelShape, layout: ParallelLayout, opts: PlanOptions, gpu: GpuSpec) -> None:
        self.shape, self.layout, self.opts, self.gpu = shape, layout, opts, gpu
        self.units = unit_shapes(shape, layout)
        self.wb = WEIGHT_BYTES[opts.weights]
        u = self.units
        self.cost = {
            "attn_heads": attn_heads_cost(u, opts.qk_method, self.wb),
            # MLA: the same check_full on the two projections from the hidden state (work.py).
            "attn_full": full_cost(u.full_q_rows, u.full_k_rows, u.hidden, opts.full_matrix_method,
                                   opts.full_matrix_rank, opts.wq_norm_power_iters, self.wb),
        }
        self.tokens = router_tokens_per_micro_batch(shape, layout)
        self.micro_batches = micro_batches_per_step(shape, layout)
        if shape.num_experts is not None:
            self.cost["router_stats"] = router_stats_cost(self.tokens, shape.num_experts)
            self.cost["router_weights"] = router_weight_cost(shape.num_experts, shape.hidden_size)
        # Bytes a full-matrix owner receives in one TP gather (snapshot step and check step).
        self.gather_bytes = u.gathered_elements(layout.tp) * self.wb * (layout.tp - 1) / layout.tp
        self.router_vector_bytes = 8 * ((shape.num_experts or 0) + opts.router_bins + 3)
        # The Q and K rows of the TP-local linear_qkv weight in FP32 (all its rows when a query
        # group spans TP ranks): what the main-parameter reader gathers to a using replica per layer.
        ng, tp = shape.num_query_groups, layout.tp
        self.qk_main_bytes: float
        if u.latent is not None:  # the rank's MLA tensors (PlanOptions.distributed_optimizer)
            self.qk_main_bytes = 4.0 * u.heads_elements
        else:
            rows = (shape.num_attention_heads + (ng if ng >= tp else 2 * ng)) * shape.kv_channels / tp
            self.qk_main_bytes = 4 * rows * shape.hidden_size
        # A using replica receives every other DP rank's part: (dp - 1) / dp of those rows.
        self.main_gather_bytes = self.qk_main_bytes * (layout.dp - 1) / layout.dp
        self.layers_per_stage = shape.num_layers // layout.pp

    def counts(self, cls: RankClass) -> dict[str, float]:
        w = cls.work
        full = w.full_units if self.opts.full_matrix_dw else 0
        return {
            "attn_heads": w.head_units,
            "attn_full": full,
            "tp_gather": 2 * full if self.gather_bytes > 0 else 0,
            "main_param_gather": 2 * self.main_param_users(cls.example[0]),
            "snapshot_copy": 1 if (w.head_units or full) else 0,
            "router_stats": w.routers * self.micro_batches,
            "router_allreduce": w.routers,
            "router_weights": w.reporting_routers,
        }

    def main_param_users(self, stage: int) -> int:
        """Gathers of FP32 main Q/K rows per read on pipeline stage ``stage``: one per layer and
        replica that uses the layer (per-head replica ``(L - 1) % dp``, full-matrix replica
        ``((L - 1) % (dp * tp)) // tp`` when it differs); every DP rank takes part in each."""
        if not (self.opts.distributed_optimizer and self.opts.weights == "main" and self.layout.dp > 1):
            return 0
        dp, tp = self.layout.dp, self.layout.tp
        layers = range(stage * self.layers_per_stage + 1, (stage + 1) * self.layers_per_stage + 1)
        users = 0
        for layer in layers:
            replicas = {(layer - 1) % dp}
            if self.opts.full_matrix_dw:
                replicas.add(((layer - 1) % (dp * tp)) // tp)
            users += len(replicas)
        return users

    def snapshot_elements(self, cls: RankClass, overlap: int) -> int:
        w = cls.work
        if not self.opts.full_matrix_dw:
            return overlap * w.head_units * self.units.heads_elements
        return w.snapshot_elements(self.units, overlap)

    def flops(self, cls: RankClass) -> dict[str, dict]:
        counts = self.counts(cls)
        out = {}
        for name, cost in self.cost.items():
            n = counts[name]
            out[name] = {"units": n, "per_unit": cost.as_dict(), "flops": cost.flops * n}
        return out


def attn_heads_cost(u: UnitShapes, qk_method: str, weight_bytes: int) -> Cost:
    """One per-head unit: classic ``check_heads``, or the MLA kernel on the rank's heads."""
    if u.latent is not None:
        return _mla_cost(u, u.heads, weight_bytes)
    return heads_cost(u.heads, u.groups, u.head_dim, u.hidden, qk_method, weight_bytes)


def _mla_cost(u: UnitShapes, heads: int, weight_bytes: int) -> Cost:
    """The MLA kernel on ``heads`` heads of the unit's layer (fewer than the rank's when measured reduced)."""
    lat = u.latent
    assert lat is not None
    return mla_heads_cost(heads, u.hidden, q_lora_rank=lat.q_lora_rank, kv_lora_rank=lat.kv_lora_rank,
                          d_nope=lat.d_nope, d_rope=lat.d_rope, weight_bytes=weight_bytes)


def _estimated_unit_times(units: _Units) -> dict[str, float]:
    """Reference-GPU time of one unit of each component (FLOP model)."""
    gpu = units.gpu
    times = {name: gpu.time_s(cost, latency_s=gpu.call_latency_s if name.startswith("attn") else
                              gpu.launch_latency_s) for name, cost in units.cost.items()}
    times["tp_gather"] = gpu.link_time_s(units.gather_bytes)
    times["router_allreduce"] = gpu.allreduce_latency_s
    # One gather to a using replica: it receives (dp - 1) / dp of the rows over the network.
    times["main_param_gather"] = (units.main_gather_bytes / (gpu.eff_link * gpu.network_bytes_per_s)
                                  + gpu.allreduce_latency_s)
    times["snapshot_copy_per_byte"] = 2.0 / (gpu.eff_mem * gpu.hbm_bytes_per_s)  # read + write
    return times


KERNEL_EFFICIENCY = 0.1
"""The monitor kernels (thin QR, eigendecompositions and SVDs in float64, randomized range
finders) run at about a tenth of a float32 matmul's FLOP rate: measured on CPU at llama3-8b
``--tp 8``, ``check_full`` 8.3 GFLOP/s and ``check_heads`` 14 GFLOP/s against 87 for the matmul.
Only the rough time announced before measuring uses it."""

COPY_BYTES_PER_S = 2e9
"""A snapshot copy's rough rate (read + write of host memory) for the same announcement."""

UNIT_NAMES = {
    "attn_heads": "check_heads (one layer's per-head Delta spectra)",
    "attn_heads_mla": "mla_delta2_singular_values (one MLA layer's per-head Delta2 spectra)",
    "attn_full": "check_full (one layer's whole-matrix dW spectra)",
    "snapshot_copy": "one snapshot copy",
    "router_stats": "summarize_routing (one micro-batch of one router)",
    "router_weights": "router-weight similarity and conditioning",
}


def measured_units(units: _Units, per_set_bytes: int) -> list[str]:
    """The components :func:`_measured_unit_times` times, in its order."""
    names = ["attn_heads"] + (["attn_full"] if units.opts.full_matrix_dw else [])
    if per_set_bytes > 0:
        names.append("snapshot_copy")
    if units.shape.num_experts is not None:
        names += ["router_stats", "router_weights"]
    return names


def rough_measure_seconds(units: _Units, per_set_bytes: int) -> float:
    """About how long the measurement takes on this device: each unit's FLOPs at
    :data:`KERNEL_EFFICIENCY` of a matmul's rate measured here, times its calls (a warm-up plus
    ``repeats``, one call when slower than ``measure.SLOW_CALL_S``). Right within a factor of a few."""
    opts = units.opts
    rate = KERNEL_EFFICIENCY * measure.matmul_flops_per_s(torch.device(opts.device))
    total = 0.0
    for name in measured_units(units, per_set_bytes):
        if name == "snapshot_copy":
            seconds = per_set_bytes / COPY_BYTES_PER_S
        else:
            seconds = units.cost[name].flops / rate
        total += seconds * (1 if seconds > measure.SLOW_CALL_S else 1 + opts.repeats)
    return total


def _measured_unit_times(units: _Units, per_set_bytes: int,
                         progress: Optional[Callable[[str], None]] = None) -> dict[str, measure.Timing]:
    """Time one unit of each component on the device. A unit whose inputs and float64 work space
    do not fit in half the free memory is timed at a reduced shape (heads, groups or rows divided
    by 2, 4, ...) and scaled up by the FLOP ratio; the ``what`` of its timing says so.

    ``progress`` hears one line before the measurement (what is timed, roughly how long it takes,
    that ``--no-measure`` skips it), one before each unit and one at the end: a measurement can
    take minutes on a CPU."""
    opts, u = units.opts, units.units
    device = torch.device(opts.device)
    dtype = WEIGHT_DTYPES[opts.weights]
    out: dict[str, measure.Timing] = {}
    say = progress or (lambda line: None)
    names = measured_units(units, per_set_bytes)
    if progress is not None:
        calls = ("one timed call each" if opts.repeats < 1 else
                 f"1 warm-up + {opts.repeats} timed call{'' if opts.repeats == 1 else 's'} each, one call when slower "
                 f"than {measure.SLOW_CALL_S:g} s")
        say(f"measuring {len(names)} kernel units on {device.type} ({', '.join(names)}; {calls}): roughly "
            f"{_duration(rough_measure_seconds(units, per_set_bytes))} here; --no-measure skips this (FLOP model "
            "only, every time labelled estimated)")
    started = time.perf_counter()
    position = iter(range(1, len(names) + 1))

    def unit(name: str) -> None:
        k = next(position)
        elapsed = f" ({_duration(time.perf_counter() - started)} so far)" if k > 1 else ""
        label = "attn_heads_mla" if name == "attn_heads" and u.latent is not None else name
        say(f"measuring {k}/{len(names)}: {UNIT_NAMES[label]}{elapsed}")

    unit("attn_heads")
    timing = _measure_heads_unit(units, device, dtype)
    if timing is not None:
        out["attn_heads"] = timing
    if opts.full_matrix_dw:
        k = _reduction(lambda k: measure.full_memory(_div(u.full_q_rows, k), _div(u.full_k_rows, k), u.hidden,
                                                     units.wb), device)
        unit("attn_full")
        if k is not None:
            q_rows, k_rows = _div(u.full_q_rows, k), _div(u.full_k_rows, k)
            timing = measure.measure_full(
                q_rows, k_rows, u.hidden, device=device, dtype=dtype, method=opts.full_matrix_method,
                rank=opts.full_matrix_rank, norm_iters=opts.wq_norm_power_iters, alpha=opts.alpha,
                repeats=opts.repeats, names=_full_names(u))
            reduced = full_cost(q_rows, k_rows, u.hidden, opts.full_matrix_method, opts.full_matrix_rank,
                                opts.wq_norm_power_iters, units.wb)
            out["attn_full"] = _scale_up(timing, units.cost["attn_full"].flops / reduced.flops)
    if per_set_bytes > 0:
        unit("snapshot_copy")
        if measure.fits(2 * per_set_bytes, device):
            out["snapshot_copy"] = measure.measure_copy(per_set_bytes, device=device, target=None,
                                                        repeats=opts.repeats)
    shape = units.shape
    if shape.num_experts is not None:
        unit("router_stats")
        out["router_stats"] = measure.measure_router_stats(
            units.tokens, shape.num_experts, shape.moe_router_topk, opts.router_bins, device=device,
            repeats=opts.repeats)
        unit("router_weights")
        out["router_weights"] = measure.measure_router_weights(
            shape.num_experts, shape.hidden_size, device=device, repeats=opts.repeats)
    say(f"measured in {_duration(time.perf_counter() - started)}")
    return out


def _measure_heads_unit(units: _Units, device: torch.device, dtype: torch.dtype) -> Optional[measure.Timing]:
    """One per-head unit timed with its kernel (classic ``check_heads`` or the MLA kernel), at the
    largest head count that fits in memory, scaled up by FLOPs (None: not even one head fits)."""
    opts, u = units.opts, units.units
    lat = u.latent
    if lat is not None:
        k = _reduction(lambda k: measure.mla_heads_memory(_div(u.heads, k), u.hidden, lat, units.wb), device)
    else:
        k = _reduction(lambda k: measure.heads_memory(_div(u.heads, k), _div(u.groups, k), u.head_dim, u.hidden,
                                                      units.wb), device)
    if k is None:
        return None
    heads = _div(u.heads, k)
    if lat is not None:
        timing = measure.measure_mla_heads(heads, u.hidden, lat, device=device, dtype=dtype, repeats=opts.repeats)
        reduced = _mla_cost(u, heads, units.wb)
    else:
        groups = _div(u.groups, k)
        timing = measure.measure_heads(heads, groups, u.head_dim, u.hidden, device=device, dtype=dtype,
                                       method=opts.qk_method, alpha=opts.alpha, repeats=opts.repeats)
        reduced = heads_cost(heads, groups, u.head_dim, u.hidden, opts.qk_method, units.wb)
    return _scale_up(timing, units.cost["attn_heads"].flops / reduced.flops)


def _full_names(u: UnitShapes) -> tuple[str, str]:
    """What the full-matrix unit's two matrices are, for the measurement's text."""
    if u.latent is None:
        return "W_q", "W_k"
    return ("linear_q_proj" if u.latent.q_lora_rank is None else "linear_q_down_proj"), "linear_kv_down_proj"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


def _div(n: int, k: int) -> int:
    return max(1, -(-n // k))


def _reduction(memory_of, device: torch.device) -> Optional[int]:
    """Smallest power-of-two divisor k whose unit fits on ``device`` (None: not even k = 4096)."""
    k = 1
    while k <= 4096:
        if measure.fits(memory_of(k), device):
            return k
        k *= 2
    return None


def _scale_up(timing: measure.Timing, factor: float) -> measure.Timing:
    if factor == 1.0:
        return timing
    return measure.Timing(timing.seconds * factor, timing.timed_calls,
                          f"{timing.what} [reduced to fit memory; scaled x {factor:.3g} by FLOPs]")


def _components(
    units: _Units, cls: RankClass, per_set_bytes: int, estimated: dict[str, float],
    measured: Optional[dict[str, measure.Timing]], measured_copy_bytes: int,
) -> dict[str, _Component]:
    counts = units.counts(cls)
    gpu_note = f"FLOP model, {units.gpu.name}"
    out = {}
    for name in COMPONENTS:
        n = counts[name]
        if name == "snapshot_copy":
            est_unit = estimated["snapshot_copy_per_byte"] * per_set_bytes
        else:
            est_unit = estimated.get(name, 0.0)
        scaled = _scaled_note(name, n, units)
        timing = measured.get(name) if measured is not None else None
        if timing is not None:
            unit = timing.seconds
            if name == "snapshot_copy":  # measured for the worst rank's set, scaled by bytes
                unit = timing.seconds * per_set_bytes / max(1, measured_copy_bytes)
            what = f"{timing.what}, median of {timing.timed_calls}"
            out[name] = _Component(unit, n, "measured", what, scaled)
        else:
            reason = gpu_note
            if measured is not None and name == "snapshot_copy" and n:
                reason += "; not measured: the copy does not fit in half the free device memory"
            elif name in ("tp_gather", "router_allreduce", "main_param_gather"):
                reason = f"communication, {gpu_note}"
            out[name] = _Component(est_unit, n, "estimated", None, f"{scaled} ({reason})")
    return out


def _scaled_note(name: str, n: float, units: _Units) -> str:
    notes = {
        "attn_heads": f"x {n:g} layers whose per-head work this rank does",
        "attn_full": f"x {n:g} layers whose full-matrix work this rank does",
        "tp_gather": f"x {n:g} TP gathers of {units.gather_bytes / 2**20:.1f} MiB (snapshot + check per layer)",
        "snapshot_copy": "one snapshot set per interval, scaled by this rank's bytes",
        "router_stats": f"x {n:g} (routers on the stage x {units.micro_batches} micro-batches of the check step)",
        "router_allreduce": f"x {n:g} all-reduces of {units.router_vector_bytes} bytes",
        "main_param_gather": f"x {n:g} DP gathers of FP32 Q/K rows, {units.main_gather_bytes / 2**20:.1f} MiB to "
                             "the using replica (per layer and using replica of the stage, on the check and the "
                             "snapshot step)",
        "router_weights": f"x {n:g} routers this rank reports",
    }
    return notes[name]


def _rank(cls: RankClass) -> dict[str, int]:
    p, d, t = cls.example
    return {"pp": p, "dp": d, "tp": t}


def build_report(shape: ModelShape, layout: ParallelLayout, opts: PlanOptions,
                 progress: Optional[Callable[[str], None]] = None) -> dict:
    """The plan as one JSON-ready dict (raises ``PlanInputError`` for bad input). ``progress``
    hears what the measurement does while it runs (``_measured_unit_times``); the report is the
    same with or without it."""
    start = time.perf_counter()
    validate(shape, layout)
    opts.validate()
    gpu = GPUS[opts.gpu]
    overlap = MechmonConfig(interval=opts.interval, delta=opts.delta).overlap
    units = _Units(shape, layout, opts, gpu)
    classes = rank_classes(shape, layout)
    elements = {id(c): units.snapshot_elements(c, overlap) for c in classes}
    snap_cls = max(classes, key=lambda c: elements[id(c)])
    snapshot_bytes = elements[id(snap_cls)] * units.wb
    per_set = {id(c): elements[id(c)] * units.wb // overlap for c in classes}

    estimated = _estimated_unit_times(units)
    measured = None
    copy_bytes = per_set[id(snap_cls)]
    if opts.measure:
        measured = _measured_unit_times(units, copy_bytes, progress)

    def components(c: RankClass, use_measured: bool) -> dict[str, _Component]:
        return _components(units, c, per_set[id(c)], estimated, measured if use_measured else None, copy_bytes)

    def total(comps: dict[str, _Component]) -> float:
        return sum(x.time_s for x in comps.values())

    flops_of = {id(c): sum(v["flops"] for v in units.flops(c).values()) for c in classes}
    flops_cls = max(classes, key=lambda c: flops_of[id(c)])
    main = {id(c): components(c, opts.measure) for c in classes}
    time_cls = max(classes, key=lambda c: total(main[id(c)]))
    ref = {id(c): components(c, False) for c in classes}
    ref_cls = max(classes, key=lambda c: total(ref[id(c)]))

    if opts.step_time_s is not None:
        step_time, step_source = opts.step_time_s, "given (--step-time-s)"
    else:
        step_time = estimated_step_time_s(shape, layout, gpu, opts.mfu)
        step_source = (f"estimated: {step_flops(shape):.3e} FLOPs per step (6 x {shape.params_per_token():.3e} params "
                       f"+ attention, x {shape.global_batch_size} x {shape.seq_length} tokens) / ({layout.world_size} "
                       f"GPUs x {gpu.bf16_flops / 1e12:.0f} TFLOP/s BF16 x MFU {opts.mfu})")

    main_comps = main[id(time_cls)]
    labels = {c.label for c in main_comps.values() if c.units}
    label = "estimated" if labels <= {"estimated"} else ("measured" if labels == {"measured"} else "measured+estimated")
    check_time = total(main_comps)
    ref_time = total(ref[id(ref_cls)])
    device_name = _device_name(opts.device) if opts.measure else gpu.name
    device = opts.device if opts.measure else f"reference GPU {opts.gpu} (--no-measure)"
    comm = check_comm_bytes(shape, layout)  # the records to the writer and the verdict back
    report = {
        "model": {**asdict(shape), "params_per_token": shape.params_per_token()},
        "layout": {**asdict(layout), "world_size": layout.world_size, "sequence_parallel": layout.sequence_parallel},
        "settings": {
            "interval": opts.interval, "delta": opts.delta, "overlap": overlap, "weights": opts.weights,
            "bytes_per_element": units.wb, "qk_method": opts.qk_method, "full_matrix_dw": opts.full_matrix_dw,
            "distributed_optimizer": opts.distributed_optimizer,
            "full_matrix_method": opts.full_matrix_method, "full_matrix_rank": opts.full_matrix_rank,
            "wq_norm_power_iters": opts.wq_norm_power_iters, "router_entropy_bins": opts.router_bins,
            "router_tokens_per_micro_batch": units.tokens, "micro_batches_per_step": units.micro_batches,
        },
        "unit_shapes": asdict(units.units),
        "attention": attention_summary(units.units, layout.tp),
        "snapshot_bytes_per_rank": snapshot_bytes,
        "snapshot_mib_per_rank": snapshot_bytes / 2**20,
        "snapshot_rank": _rank(snap_cls),
        "check_flops_per_rank": {"total": flops_of[id(flops_cls)], "rank": _rank(flops_cls),
                                 "components": units.flops(flops_cls)},
        "check_time_s_per_rank": {
            "total": check_time, "label": label, "device": device, "device_name": device_name,
            "rank": _rank(time_cls), "components": {k: v.as_dict() for k, v in main_comps.items()},
        },
        "check_comm_bytes_per_rank": comm["per_rank"],
        "check_comm_bytes_writer": comm["writer"],
        "check_comm": comm,
        "step_time_s": step_time,
        "step_time_source": step_source,
        "overhead_share": check_time / opts.interval / step_time,
        "target_share": TARGET_SHARE,
        "meets_target": check_time / opts.interval / step_time <= TARGET_SHARE,
        "reference_gpu_estimate": {
            "label": "estimated", "gpu": gpu.as_dict(), "check_time_s_per_rank": ref_time, "rank": _rank(ref_cls),
            "components": {k: v.as_dict() for k, v in ref[id(ref_cls)].items()},
            "overhead_share": ref_time / opts.interval / step_time,
        },
        "rank_classes": [
            {"count": c.count, "rank": _rank(c), **asdict(c.work), "snapshot_bytes": elements[id(c)] * units.wb,
             "check_flops": flops_of[id(c)], "check_time_s": total(main[id(c)])}
            for c in classes
        ],
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "machine": cpu_name(), "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        },
    }
    lag = change_point_lag(opts.interval, opts.delta)
    report["rollback"] = {
        "change_point_lag_steps": lag, "lag_checks": MEASURED_LAG_CHECKS,
        "source": "largest alarm - change point of the detector study's records at the default rate "
                  "(session/rollback_reach.py, docs/RECOVERY.md)",
        "keep_checkpoints_at_save_interval": {str(s): reach(s, opts.interval, opts.delta).keep_needed
                                              for s in (100, 500, 1000)},
    }
    report["planner_wall_s"] = time.perf_counter() - start
    return report


def attention_summary(u: UnitShapes, tp: int) -> dict:
    """What one attention unit reads (elements per tensor, ``[out, in]`` shapes): the per-head
    unit of one rank and layer, the full-matrix unit, and whether the latter is TP-gathered."""
    if u.latent is None:
        heads = {"W_q rows": u.heads * u.head_dim * u.hidden, "W_k rows": u.groups * u.head_dim * u.hidden}
        full = {"W_q": [u.full_q_rows, u.hidden], "W_k": [u.full_k_rows, u.hidden]}
        kind = "classic"
    else:
        heads = mla_snapshot_elements(u.heads, u.hidden, u.latent)
        q_name = _full_names(u)[0]
        full = {q_name: [u.full_q_rows, u.hidden], "linear_kv_down_proj": [u.full_k_rows, u.hidden]}
        kind = "multi-head latent attention"
    return {"kind": kind, "heads_unit_elements": heads, "full_unit_shapes": full,
            "full_unit_gathered_elements": u.gathered_elements(tp)}


def _device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return cpu_name()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _attention_text(m: dict) -> str:
    """The model line's attention part."""
    if not m["multi_latent_attention"]:
        return f"{m['num_query_groups']} K groups, head dim {m['kv_channels']}"
    q = f"q_lora_rank {m['q_lora_rank']}" if m["q_lora_rank"] is not None else "no query latent"
    return (f"multi-head latent attention ({q}, kv_lora_rank {m['kv_lora_rank']}, q/k head dim "
            f"{m['qk_head_dim']} + {m['qk_pos_emb_head_dim']} RoPE, v head dim {m['v_head_dim']})")


def _mla_lines(report: dict) -> list[str]:
    """What one MLA layer's units read on the most loaded rank (nothing for classic attention)."""
    att = report["attention"]
    if att["kind"] == "classic":
        return []
    wb = report["settings"]["bytes_per_element"]
    heads = att["heads_unit_elements"]
    full = " + ".join(f"{name} {shape}" for name, shape in att["full_unit_shapes"].items())
    gathered = "TP-gathered" if att["full_unit_gathered_elements"] else "replicated, no TP gather"
    return [
        f"MLA per-head unit ({report['unit_shapes']['heads']} heads of a layer on a rank): "
        f"{sum(heads.values()) * wb / 2**20:.1f} MiB = " + ", ".join(f"{k} {v:,}" for k, v in heads.items())
        + " elements",
        f"MLA full-matrix unit: dW spectra of {full} ({gathered})",
    ]


def format_table(report: dict) -> str:
    """A terminal rendering of ``report``."""
    m, lay, s = report["model"], report["layout"], report["settings"]
    ct, ref = report["check_time_s_per_rank"], report["reference_gpu_estimate"]
    lines = [
        f"model {m['name']}: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
        + _attention_text(m) + (f", {m['num_experts']} experts top-{m['moe_router_topk']}" if m["num_experts"] else ""),
        f"layout TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']} (EP {lay['ep']}) = {lay['world_size']} ranks; "
        f"interval {s['interval']}, delta {s['delta']} ({s['overlap']} snapshot set(s)), {s['weights']} weights "
        f"({s['bytes_per_element']} B/elem)",
        f"snapshots: {report['snapshot_mib_per_rank']:.1f} MiB on the most loaded rank {report['snapshot_rank']}",
        *_mla_lines(report),
        f"check FLOPs: {report['check_flops_per_rank']['total']:.3e} on rank {report['check_flops_per_rank']['rank']}",
        f"check records exchange: {report['check_comm_bytes_writer']:,} bytes on the writer, at most "
        f"{report['check_comm_bytes_per_rank']:,} on any other rank ({report['check_comm']['reporting_ranks']} "
        "reporting ranks)",
        "",
        f"{'component':<22}{'units':>8}{'unit [s]':>12}{'total [s]':>12}  {'label':<20}"
        f"{'ref GPU [s]':>12}",
    ]
    for name, comp in ct["components"].items():
        rc = ref["components"][name]
        lines.append(f"{name:<22}{comp['units']:>8g}{comp['unit_time_s']:>12.4g}{comp['time_s']:>12.4g}  "
                     f"{comp['label']:<20}{rc['time_s']:>12.4g}")
    lines += [
        f"{'check total':<42}{ct['total']:>12.4g}  {ct['label']:<20}{ref['check_time_s_per_rank']:>12.4g}",
        "",
        f"times from: {ct['device']} ({ct['device_name']}); last column: {ref['gpu']['name']} (estimated)",
        f"step time: {report['step_time_s']:.3g} s ({report['step_time_source']})",
        f"overhead share (check / interval / step): {report['overhead_share']:.3%} on {ct['device']} "
        f"[{ct['label']}], {ref['overhead_share']:.4%} on the reference GPU [estimated]; target "
        f"<= {report['target_share']:.0%}",
        f"rollback: the change point lies up to {report['rollback']['change_point_lag_steps']} steps before an "
        f"alarm at this interval and delta (measured); checkpoints to keep at --save-interval "
        + ", ".join(f"{k}: {v}" for k, v in report["rollback"]["keep_checkpoints_at_save_interval"].items()),
        f"planner wall time: {report['planner_wall_s']:.1f} s",
    ]
    return "\n".join(lines)
