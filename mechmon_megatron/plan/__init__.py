"""The planner (``mechmon-plan``): what the monitors cost at a model shape and parallel layout.

Given a preset (Llama-3 8B / 70B / 405B; DeepSeek-V3 and Kimi K2, MoE with multi-head latent
attention) or explicit shape flags and a TP x PP x DP (x EP) layout, it counts every rank's
monitor work per check (the session's work model, ``work``), the snapshot memory, the FLOPs per
component (``flops``), times one unit of each component on the current device with the session's
own kernels (``measure``), and puts the check time, amortised over the interval, next to the
training step time (``report``; a reference-GPU FLOP-model estimate in ``estimate``). Entry
point: ``cli.main``.

Imports: the core (``monitors``), the session and torch only (tests/test_architecture.py).
"""

from mechmon_megatron.plan.report import PlanOptions, build_report, format_table
from mechmon_megatron.plan.shapes import PRESETS, ModelShape, ParallelLayout, PlanInputError

__all__ = ["PRESETS", "ModelShape", "ParallelLayout", "PlanInputError", "PlanOptions", "build_report", "format_table"]
