"""Fault-study scenarios: each scenario is a named set of example-trainer flags, defined once.

Every run trains the same small GPT-MoE with megatron-core (``examples/pretrain_scripts``),
the emulated BF16 flash attention (``--attention-backend emulated-lowp-fa``) and the mechanism
monitors in ``log`` mode (alarms are recorded, training goes on). A scenario adds its fault:

==========  ===============================================================================
clean       no fault: the control (fault injector off, base learning rate and batch size).
fa          amplified biased rounding of O in the FA backward's ``delta`` on all rows
            (``--fa-fault-mode all_rows``) from ``fault_onset``; attention-family fault.
moe-lr      the router's "stable winner" loop driven by a high learning rate (from step 1).
moe-gbs     the same loop driven by a small global batch (margin noise) from step 1.
combined    ``fa`` and ``moe-lr`` together.
moe-router-lr
            a high learning rate on the router weights only (``--router-lr-mult``), from
            step 1: the routing fault without touching the attention weights' updates, which
            is what the paper's orthogonality claim is about.
==========  ===============================================================================

The fa fault is *amplified*: the faithful variant (bias only on rows with a tied score maximum)
does not trigger on models this small within a CPU budget (docs/METHOD.md section 8), so the bias is
applied on every row with a strength of many BF16 ulps.

A :class:`Preset` fixes the model size, the run length and the monitor schedule for a study:
``demo`` (what ``make demo`` runs in <= 10 minutes on 2 cores) and ``full`` (docs/RESULTS.md);
``full-mla`` and ``full-qknorm`` are the full study on two attention variants of its model
(multi-head latent attention; per-head QK-norm), everything else the same.
Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Optional

from mechmon_megatron.detect.phase_moments import TrainingSchedule

FaultFamily = Literal["none", "attn", "router", "both"]

SCENARIO_NAMES: tuple[str, ...] = ("clean", "fa", "moe-lr", "moe-gbs", "combined", "moe-router-lr")


CALIBRATED_DETECTOR: dict[str, float] = {"false_alarm_rate": 0.01}
"""The detector setting of every preset: the session default. The detector's calibration is its
null-tail table (fitted on healthy runs of the detector study, docs/RESULTS.md), not a per-study
choice; ``--calibration-seed`` still picks a rate on a clean run when asked."""

@dataclass(kw_only=True, frozen=True, slots=True)
class Preset:
    """Model size, run length and monitor schedule shared by every scenario of one study."""

    name: str
    """Preset name (a key of :data:`PRESETS`)."""

    train_iters: int
    """Optimizer steps per run."""

    model_flags: tuple[str, ...]
    """Trainer flags of the base model (size, optimiser, MoE layout)."""

    base_lr: float
    """Peak learning rate of the healthy runs (``--lr``)."""

    high_lr: float
    """Peak learning rate of the ``moe-lr`` fault."""

    base_global_batch: int
    """Global batch size (sequences) of the healthy runs."""

    small_global_batch: int
    """Global batch size of the ``moe-gbs`` fault (with micro-batch size = this value)."""

    fa_strength: float
    """Fault strength in BF16 ulps of O (``--fa-fault-strength``)."""

    fa_onset: int
    """First step of the fa fault (``--fa-fault-onset``)."""

    mechmon_interval: int
    """Steps between monitor checks (``--mechmon-interval``)."""

    mechmon_delta: int
    """Increment window in steps (``--mechmon-delta``)."""

    router_lr_mult: float = 15.0
    """``--router-lr-mult`` of the ``moe-router-lr`` fault: the router's LR schedule times this.
    15 is the whole-model LR multiple that collapsed routing on every seed of the DeepSpeed LR
    study (docs/RESULTS.md); here it is applied to the router alone."""

    lr_decay_iters: Optional[int] = None
    """``--lr-decay-iters`` (default: the run length). The demo decays over the full study's
    1,500 steps, so its 1,000 steps follow the same LR schedule as the full study."""

    seeds: tuple[int, ...] = (1,)
    """Default seeds of the reported runs."""

    scenarios: tuple[str, ...] = SCENARIO_NAMES
    """Default scenarios."""

    calibration_seed: Optional[int] = None
    """Seed of the clean run on which the detector setting is chosen (never a reported seed);
    None: use ``detector`` as it is."""

    detector: dict = field(default_factory=lambda: dict(CALIBRATED_DETECTOR))
    """Detector setting (``analysis.DetectorSetting`` fields) when there is no calibration run."""


# Base model: 4 layers, hidden 128, 4 heads, seq 128, 8 experts top-2 in every layer, byte-level
# stdlib corpus. AdamW, warmup 100 steps, cosine decay to min-lr; aux loss 1e-2 (a usual setting).
_MODEL = (
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--ffn-hidden-size", "256",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
    "--lr-warmup-iters", "100", "--attention-backend", "emulated-lowp-fa",
)

_FULL = Preset(
    name="full",
    train_iters=1500,
    model_flags=_MODEL,
    base_lr=2e-3,
    high_lr=8e-3,
    base_global_batch=4,
    small_global_batch=1,
    fa_strength=32.0,
    fa_onset=500,
    mechmon_interval=20,
    mechmon_delta=100,
    seeds=(1, 2, 3),
    scenarios=SCENARIO_NAMES,
    calibration_seed=None,
)

_MLA_FLAGS = (
    "--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32",
    "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm",
)
"""Multi-head latent attention on the full model (hidden 128, 4 heads of 32), DeepSeek-V3's layout
scaled down: a query latent of hidden/2 = 64 and a key/value latent of hidden/4 = 32, both behind
their RMSNorm (``--qk-layernorm``; RMSNorm is the trainer's default with MLA, as in DeepSeek-V3),
the no-RoPE query/key head dim and the value head dim equal to the full model's head dim 32 (so
per-head value width and attention output size are the full model's), a RoPE part of half that
(16), the ratio of DeepSeek-V3's 64 to 128. DeepSeek-V3's own latent fractions (1536/7168 and
512/7168 of hidden) would leave a 9-dim key/value latent here, below one head's width; hidden/4
keeps the latent a real compression (4 heads x (32 + 32) key and value dims from 32) that still
trains on CPU."""

_QK_NORM_FLAGS = ("--qk-layernorm",)
"""Per-head QK-norm on the full model (a norm of head width 32 on every query and key head, the
OLMo-2 / Qwen3 recipe), and nothing else changed: the same heads (no extra grouping) and the same
norm type as the full model (LayerNorm), so that any difference from ``full`` is the QK-norm's."""


def _attention_variant(base: Preset, name: str, flags: tuple[str, ...]) -> Preset:
    """``base`` with ``flags`` added to its model flags: the same size, layers, experts, LR, run
    length, faults and monitor schedule."""
    return replace(base, name=name, model_flags=base.model_flags + flags)


PRESETS: dict[str, Preset] = {
    # The demo is the full study cut short: same model, faults and schedule (the LR decays over
    # the full study's 1,500 steps), fewer runs, an earlier FA onset, the calibrated detector.
    "demo": replace(
        _FULL, name="demo", train_iters=1000, lr_decay_iters=1500, fa_onset=400, seeds=(1,),
        scenarios=("clean", "fa", "moe-lr"), calibration_seed=None,
    ),
    "full": _FULL,
    "full-mla": _attention_variant(_FULL, "full-mla", _MLA_FLAGS),
    "full-qknorm": _attention_variant(_FULL, "full-qknorm", _QK_NORM_FLAGS),
}


@dataclass(kw_only=True, frozen=True, slots=True)
class Scenario:
    """One fault scenario: its flags on top of the preset's base model."""

    name: str
    description: str
    fault_family: FaultFamily
    """Which monitor family the fault targets (for the orthogonality matrix)."""
    fa_fault: bool = False
    lr: Literal["base", "high"] = "base"
    global_batch: Literal["base", "small"] = "base"
    router_lr: Literal["base", "high"] = "base"

    def fault_onset(self, preset: Preset) -> Optional[int]:
        """First faulty step: the fa onset, 1 for a misconfiguration present from the start,
        None for the clean control."""
        if self.fa_fault:
            return preset.fa_onset
        if self.fault_family == "none":
            return None
        return 1

    def router_fault_onset(self, preset: Preset) -> Optional[int]:
        """First step of a router-family fault (high LR, small batch, high router LR: 1), else None."""
        return 1 if self.lr == "high" or self.global_batch == "small" or self.router_lr == "high" else None


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(name="clean", description="no fault (control)", fault_family="none"),
        Scenario(
            name="fa",
            description="amplified biased BF16 rounding of O in the FA backward delta, all rows",
            fault_family="attn",
            fa_fault=True,
        ),
        Scenario(name="moe-lr", description="MoE with a high learning rate", fault_family="router", lr="high"),
        Scenario(
            name="moe-gbs", description="MoE with a small global batch", fault_family="router", global_batch="small"
        ),
        Scenario(
            name="combined",
            description="fa fault and high learning rate together",
            fault_family="both",
            fa_fault=True,
            lr="high",
        ),
        Scenario(
            name="moe-router-lr", description="MoE with a high learning rate on the router weights only",
            fault_family="router", router_lr="high",
        ),
    )
}


@dataclass(kw_only=True, frozen=True, slots=True)
class RunSpec:
    """One training run of the study (a scenario at a seed); paths are relative to the run dir."""

    scenario: str
    seed: int
    train_iters: int
    fault_onset: Optional[int]
    router_fault_onset: Optional[int] = None
    """Onset of the router-family part of the fault when it differs (``combined``)."""
    flags: tuple[str, ...] = field(default_factory=tuple)
    calibration: bool = False
    """True for the clean calibration run (not reported in the table)."""

    @property
    def run_id(self) -> str:
        prefix = "calib-" if self.calibration else ""
        return f"{prefix}{self.scenario}-seed{self.seed}"


METRICS_FILE = "metrics.jsonl"
MECHMON_DIR = "mechmon"
TENSORBOARD_DIR = "tensorboard"


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose from {list(SCENARIOS)} (comma-separated --scenarios).")
    return SCENARIOS[name]


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {list(PRESETS)} (--preset).")
    return PRESETS[name]


def schedule_of_flags(flags: Sequence[str]) -> TrainingSchedule:
    """The learning-rate schedule of a trainer command line: its ``--lr-warmup-iters``,
    ``--lr-decay-style`` and ``--lr`` (the example trainer's defaults, 0, ``cosine`` and 1e-3, where
    absent)."""
    flags = list(flags)

    def flag(name: str, default: str) -> str:
        return flags[flags.index(name) + 1] if name in flags else default

    return TrainingSchedule(int(flag("--lr-warmup-iters", "0")), flag("--lr-decay-style", "cosine"),
                            float(flag("--lr", "1e-3")))


def trainer_flags(scenario: Scenario, preset: Preset, seed: int, train_iters: int) -> tuple[str, ...]:
    """Trainer flags of one run, except the output paths (added by the runner)."""
    lr = preset.high_lr if scenario.lr == "high" else preset.base_lr
    gbs = preset.small_global_batch if scenario.global_batch == "small" else preset.base_global_batch
    flags = list(preset.model_flags) + [
        "--micro-batch-size", str(gbs), "--global-batch-size", str(gbs),
        "--lr", repr(lr), "--min-lr", repr(lr / 10),
        "--train-iters", str(train_iters), "--seed", str(seed),
        "--lr-decay-iters", str(preset.lr_decay_iters or train_iters),
        "--log-interval", "100", "--log-max-attention-logit",
        "--mechmon", "--mechmon-interval", str(preset.mechmon_interval),
        "--mechmon-delta", str(preset.mechmon_delta), "--mechmon-action", "log",
        "--mechmon-per-head-scalars",
        # The study measures with the exact kernels, as its records and the shipped calibration were.
        "--mechmon-full-matrix-method", "exact", "--mechmon-wq-norm-power-iters", "0",
    ]
    if scenario.router_lr == "high":
        flags += ["--router-lr-mult", repr(preset.router_lr_mult)]
    if scenario.fa_fault:
        flags += [
            "--fa-fault-strength", repr(preset.fa_strength), "--fa-fault-onset", str(preset.fa_onset),
            "--fa-fault-mode", "all_rows",
        ]
    return tuple(flags)


def plan_runs(
    scenario_names: tuple[str, ...],
    seeds: tuple[int, ...],
    preset: Preset,
    train_iters: Optional[int] = None,
    calibration_seed: Optional[int] = None,
) -> list[RunSpec]:
    """The run list: an optional clean calibration run first, then scenarios x seeds."""
    iters = preset.train_iters if train_iters is None else int(train_iters)
    if iters < 1:
        raise ValueError(f"--train-iters must be >= 1, got {iters}.")
    if calibration_seed is not None and calibration_seed in seeds:
        raise ValueError(
            f"the calibration seed {calibration_seed} is also a reported seed; detector settings must be "
            "chosen on a seed that is not reported: change --calibration-seed or --seeds."
        )
    runs = []
    if calibration_seed is not None:
        clean = get_scenario("clean")
        runs.append(
            RunSpec(
                scenario="clean", seed=calibration_seed, train_iters=iters, fault_onset=None,
                flags=trainer_flags(clean, preset, calibration_seed, iters), calibration=True,
            )
        )
    for name in scenario_names:
        scenario = get_scenario(name)
        for seed in seeds:
            runs.append(
                RunSpec(
                    scenario=name, seed=seed, train_iters=iters, fault_onset=scenario.fault_onset(preset),
                    router_fault_onset=scenario.router_fault_onset(preset),
                    flags=trainer_flags(scenario, preset, seed, iters),
                )
            )
    return runs


def with_overrides(preset: Preset, **changes) -> Preset:
    """A copy of ``preset`` with some fields changed (e.g. ``fa_onset`` for short test runs)."""
    return replace(preset, **changes)
