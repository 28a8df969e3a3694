"""Time one unit of each monitor component with the session's own kernels, on a device.

Units: ``check_heads`` for one layer's heads on one rank (with multi-head latent attention the
MLA kernel ``mla_delta2_singular_values`` on the rank's heads, :func:`measure_mla_heads`),
``check_full`` for one layer's gathered Q/K (MLA: its two projections from the hidden state),
``summarize_routing`` for one micro-batch of one router, the router-weight geometry of one
router, and one snapshot copy. Inputs are synthetic (``W ~ N(0, 0.02)``,
``dW`` Gaussian with RMS 1e-3, the magnitude of an increment over ~100 steps): the kernels' cost does not
depend on the values (the Cholesky path of ``gram`` is taken for full-rank increments).

Each call is run once as a warm-up and then ``repeats`` times (median); a call slower than
``SLOW_CALL_S`` is timed once (its warm-up is the measurement). A unit whose inputs and float64
work space would not fit in half the free memory of the device is timed by the caller at a
reduced shape and scaled (``report``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mechmon_megatron.monitors.mla_increment import MLAWeights, mla_delta2_singular_values
from mechmon_megatron.monitors.router import router_conditioning_ratio, router_weight_similarity, summarize_routing
from mechmon_megatron.plan.shapes import LatentDims
from mechmon_megatron.plan.work import mla_snapshot_elements
from mechmon_megatron.session.attention_check import check_full, check_heads
from mechmon_megatron.session.host import FullQK, QKWeights

MLA_HEAD_CHUNK = 16
"""Heads the MLA kernel processes together (its default, and the session's)."""
SLOW_CALL_S = 5.0
MEMORY_SHARE = 0.5
"""Largest share of the device's free memory a measurement may use."""


@dataclass(frozen=True)
class Timing:
    """Median seconds of one unit, how many calls were timed, and what was run."""

    seconds: float
    timed_calls: int
    what: str


def free_bytes(device: torch.device) -> int:
    """Free memory of ``device`` (CUDA: ``mem_get_info``; CPU: ``MemAvailable``)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fits(nbytes: float, device: torch.device) -> bool:
    return nbytes <= MEMORY_SHARE * free_bytes(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, int]:
    """``(median seconds, timed calls)`` of ``fn`` on ``device`` (see the module docstring)."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - start
    if first > SLOW_CALL_S or repeats < 1:
        return first, 1
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def matmul_flops_per_s(device: torch.device) -> float:
    """A float32 matmul's rate on ``device`` (FLOP/s), from a few calls (well under a second):
    the yardstick of the planner's rough time for its own measurement."""
    n = 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    seconds, _ = time_call(lambda: a @ b, device, 3)
    return 2.0 * n**3 / max(seconds, 1e-9)


def _pair(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    prev = 0.02 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    now = prev + 1e-3 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return prev.to(dtype), now.to(dtype)


def _generator(device: torch.device, seed: int = 0) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def heads_memory(heads: int, groups: int, head_dim: int, hidden: int, weight_bytes: int) -> float:
    return (heads + groups) * head_dim * hidden * (4 * weight_bytes + 6 * 8)


def full_memory(q_rows: int, k_rows: int, hidden: int, weight_bytes: int) -> float:
    return (q_rows + k_rows) * hidden * 4 * weight_bytes + 5 * 8 * q_rows * hidden


def mla_heads_memory(heads: int, hidden: int, lat: LatentDims, weight_bytes: int) -> float:
    """Bytes one :func:`measure_mla_heads` call holds at most (generous): the prev/now inputs, the
    float64 copies of the stacked down projections, one head chunk's float64 up rows (hidden-space
    query rows without a query latent) and coefficient matrices."""
    elements = sum(mla_snapshot_elements(heads, hidden, lat).values())
    chunk = min(heads, MLA_HEAD_CHUNK)
    q_width = hidden if lat.q_lora_rank is None else lat.q_lora_rank
    down = (lat.n_kv + (lat.q_lora_rank or 0)) * hidden
    rows = chunk * (lat.d_qk * q_width + lat.d_nope * lat.kv_lora_rank)
    coeff = chunk * 2 * lat.d_qk * (2 * q_width + 2 * lat.n_kv)
    return 2 * elements * weight_bytes + 8 * (8 * down + 6 * rows + 3 * coeff)


def _gamma_pair(n: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """A norm's gamma near 1 at ``t - delta`` and ``t``."""
    prev, now = _pair((n,), dtype, device, gen)
    return 1.0 + prev, 1.0 + now


def _mla_layer(heads: int, hidden: int, lat: LatentDims, dtype: torch.dtype, device: torch.device,
               gen: torch.Generator) -> tuple[MLAWeights, MLAWeights]:
    """Synthetic prev/now weights of the tensors the MLA check reads (key rows of
    ``linear_kv_up_proj`` only, as the snapshot holds them: ``d_v = 0`` for the kernel)."""
    t = {"kv_down": _pair((lat.n_kv, hidden), dtype, device, gen),
         "kv_up": _pair((heads * lat.d_nope, lat.kv_lora_rank), dtype, device, gen),
         "kv_norm": _gamma_pair(lat.kv_lora_rank, dtype, device, gen)}
    if lat.q_lora_rank is None:
        t["q_proj"] = _pair((heads * lat.d_qk, hidden), dtype, device, gen)
    else:
        t["q_down"] = _pair((lat.q_lora_rank, hidden), dtype, device, gen)
        t["q_up"] = _pair((heads * lat.d_qk, lat.q_lora_rank), dtype, device, gen)
        t["q_norm"] = _gamma_pair(lat.q_lora_rank, dtype, device, gen)
    return MLAWeights(**{k: v[0] for k, v in t.items()}), MLAWeights(**{k: v[1] for k, v in t.items()})


def measure_mla_heads(
    heads: int, hidden: int, lat: LatentDims, *, device: torch.device, dtype: torch.dtype, repeats: int
) -> Timing:
    """``mla_delta2_singular_values`` (content and whole streams) for ``heads`` heads of one MLA layer."""
    prev, now = _mla_layer(heads, hidden, lat, dtype, device, _generator(device, 4))
    seconds, calls = time_call(
        lambda: mla_delta2_singular_values(prev, now, d_nope=lat.d_nope, d_rope=lat.d_rope, num_heads=heads,
                                           head_chunk=MLA_HEAD_CHUNK),
        device, repeats,
    )
    query = "no query latent" if lat.q_lora_rank is None else f"q_lora_rank {lat.q_lora_rank}"
    what = (f"mla_delta2_singular_values({heads} heads, hidden {hidden}, {query}, kv_lora_rank {lat.kv_lora_rank}, "
            f"d_nope {lat.d_nope}, d_rope {lat.d_rope}, {str(dtype).removeprefix('torch.')}) on {device.type}")
    return Timing(seconds, calls, what)


def measure_heads(
    heads: int, groups: int, head_dim: int, hidden: int, *, device: torch.device, dtype: torch.dtype,
    method: str, alpha: float, repeats: int,
) -> Timing:
    gen = _generator(device)
    wq0, wq1 = _pair((heads, head_dim, hidden), dtype, device, gen)
    wk0, wk1 = _pair((groups, head_dim, hidden), dtype, device, gen)
    prev, now = QKWeights(wq=wq0, wk=wk0), QKWeights(wq=wq1, wk=wk1)
    seconds, calls = time_call(
        lambda: check_heads(1, prev, now, alpha=alpha, method=method, per_head_scalars=False),  # type: ignore[arg-type]
        device, repeats,
    )
    what = (f"check_heads({heads} heads, {groups} K groups, head_dim {head_dim}, hidden {hidden}, {method}, "
            f"{str(dtype).removeprefix('torch.')}) on {device.type}")
    return Timing(seconds, calls, what)


def measure_full(
    q_rows: int, k_rows: int, hidden: int, *, device: torch.device, dtype: torch.dtype, method: str,
    rank: int, norm_iters: int, alpha: float, repeats: int, names: tuple[str, str] = ("W_q", "W_k"),
) -> Timing:
    """``check_full`` on ``[q_rows, hidden]`` and ``[k_rows, hidden]`` (``names``: what the two are,
    for the ``what`` text; MLA: its down projections)."""
    gen = _generator(device, 1)
    wq0, wq1 = _pair((q_rows, hidden), dtype, device, gen)
    wk0, wk1 = _pair((k_rows, hidden), dtype, device, gen)
    prev, now = FullQK(wq=wq0, wk=wk0), FullQK(wq=wq1, wk=wk1)
    seconds, calls = time_call(
        lambda: check_full(1, prev, now, alpha=alpha, method=method, rank=rank, norm_iters=norm_iters),  # type: ignore[arg-type]
        device, repeats,
    )
    what = (f"check_full({names[0]} [{q_rows}, {hidden}], {names[1]} [{k_rows}, {hidden}], {method} rank {rank}, "
            f"{norm_iters} power iterations, {str(dtype).removeprefix('torch.')}) on {device.type}")
    return Timing(seconds, calls, what)


def measure_router_stats(
    tokens: int, experts: int, topk: int, bins: int, *, device: torch.device, repeats: int
) -> Timing:
    gen = _generator(device, 2)
    logits = torch.randn(tokens, experts, generator=gen, device=device).to(torch.bfloat16)

    def run() -> torch.Tensor:
        return summarize_routing(logits, topk, num_bins=bins).to_flat_tensor()

    seconds, calls = time_call(run, device, repeats)
    return Timing(seconds, calls, f"summarize_routing(logits [{tokens}, {experts}] bf16, top-{topk}, {bins} bins) "
                                  f"on {device.type}")


def measure_router_weights(experts: int, hidden: int, *, device: torch.device, repeats: int) -> Timing:
    gen = _generator(device, 3)
    weight = 0.02 * torch.randn(experts, hidden, generator=gen, device=device)

    def run() -> tuple[float, float]:
        return float(router_weight_similarity(weight)), float(router_conditioning_ratio(weight))

    seconds, calls = time_call(run, device, repeats)
    return Timing(seconds, calls, f"router_weight_similarity + router_conditioning_ratio([{experts}, {hidden}] fp32) "
                                  f"on {device.type}")


def measure_copy(nbytes: int, *, device: torch.device, target: Optional[str], repeats: int) -> Timing:
    """One snapshot copy of ``nbytes`` (``target``: ``None`` = same device, ``"pinned"`` = to
    page-locked host memory, CUDA only)."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device).normal_()
    if target == "pinned":
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    else:
        dst = torch.zeros_like(src)  # pages touched before the clock starts
    seconds, calls = time_call(lambda: dst.copy_(src, non_blocking=target == "pinned"), device, repeats)
    where = "pinned host memory" if target == "pinned" else "the same device"
    return Timing(seconds, calls, f"snapshot copy of {nbytes / 2**20:.3g} MiB to {where} on {device.type}")
