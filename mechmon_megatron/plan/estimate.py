"""FLOP-model time on a reference GPU and the training step-time estimate (both ``estimated``).

The GPU time of a component is ``gemm / (eff_gemm * fp64_tensor_peak) + factor / (eff_factor *
fp64_peak) + bytes / (eff_mem * hbm_bandwidth) + latency``. The efficiencies are
assumptions, stated in every report: fp64 GEMM at half the tensor-core peak; LAPACK-class
factorizations (cuSOLVER QR / batched small eigvalsh and SVD) at 5 % of the fp64 peak (they are
latency bound at these sizes); memory-bound passes at 60 % of HBM bandwidth; 1 ms per attention
kernel call and 0.1 ms per router unit for launches and host syncs. It is a planning figure
until ``tools/gpu_check.sh`` measures.

Step time without ``--step-time-s``: ``tokens * (6 N + 12 L s np h_d) / (world * bf16_peak * MFU)``
(parameters N a token passes through, plus attention scores; the PaLM / Megatron convention). With
MLA the two attention products have different widths: ``6 L s np (d_qk + d_v)`` replaces the
attention term (``ModelShape.score_dims_per_head``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mechmon_megatron.plan.flops import Cost
from mechmon_megatron.plan.shapes import ModelShape, ParallelLayout


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Vendor peak figures (dense, no sparsity) and the efficiency assumptions of the model."""

    name: str
    fp64_tensor_flops: float
    """FP64 tensor-core peak, FLOP/s (used for GEMM)."""
    fp64_flops: float
    """FP64 vector peak, FLOP/s (used for factorizations)."""
    bf16_flops: float
    """BF16 dense tensor-core peak, FLOP/s (used for the training step estimate)."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """Per-direction NVLink bandwidth per GPU (TP gathers)."""
    network_bytes_per_s: float = 50e9
    """Per-GPU inter-node bandwidth (400 Gb/s InfiniBand NDR; data-parallel all-reduces)."""
    eff_gemm: float = 0.5
    eff_factor: float = 0.05
    eff_mem: float = 0.6
    eff_link: float = 0.7
    call_latency_s: float = 1e-3
    """Per ``check_heads`` / ``check_full`` call: kernel launches and host syncs."""
    launch_latency_s: float = 1e-4
    """Per router-statistics or router-weight unit: ~20 small kernels, at most two host syncs."""
    allreduce_latency_s: float = 50e-6
    """One small all-reduce (a router's statistics vector) across the data-parallel group."""

    def time_s(self, cost: Cost, latency_s: float) -> float:
        return (
            cost.gemm / (self.eff_gemm * self.fp64_tensor_flops)
            + cost.factor / (self.eff_factor * self.fp64_flops)
            + (cost.gemv + cost.elementwise) / (self.eff_gemm * self.fp64_flops)
            + cost.bytes / (self.eff_mem * self.hbm_bytes_per_s)
            + latency_s
        )

    def link_time_s(self, nbytes: float) -> float:
        return nbytes / (self.eff_link * self.nvlink_bytes_per_s)

    def ring_allreduce_time_s(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``ranks`` GPUs on different nodes."""
        moved = 2.0 * nbytes * (ranks - 1) / ranks
        return moved / (self.eff_link * self.network_bytes_per_s) + self.allreduce_latency_s

    def as_dict(self) -> dict:
        return asdict(self)


GPUS: dict[str, GpuSpec] = {
    # NVIDIA H100 SXM5 datasheet: FP64 34 TFLOP/s, FP64 tensor 67, BF16 989 (dense), HBM3 3.35 TB/s,
    # NVLink 4 900 GB/s bidirectional.
    "h100": GpuSpec(name="NVIDIA H100 SXM (datasheet peaks)", fp64_tensor_flops=67e12, fp64_flops=34e12,
                    bf16_flops=989e12, hbm_bytes_per_s=3.35e12, nvlink_bytes_per_s=450e9),
    # H200 SXM: the H100's compute with HBM3e 4.8 TB/s.
    "h200": GpuSpec(name="NVIDIA H200 SXM (datasheet peaks)", fp64_tensor_flops=67e12, fp64_flops=34e12,
                    bf16_flops=989e12, hbm_bytes_per_s=4.8e12, nvlink_bytes_per_s=450e9),
}


def step_flops(shape: ModelShape) -> float:
    """Training FLOPs of one optimizer step (forward + backward)."""
    tokens = float(shape.global_batch_size) * shape.seq_length
    attention = 6.0 * shape.num_layers * shape.seq_length * shape.num_attention_heads * shape.score_dims_per_head()
    return tokens * (6.0 * shape.params_per_token() + attention)


def estimated_step_time_s(shape: ModelShape, layout: ParallelLayout, gpu: GpuSpec, mfu: float) -> float:
    return step_flops(shape) / (layout.world_size * gpu.bf16_flops * mfu)
