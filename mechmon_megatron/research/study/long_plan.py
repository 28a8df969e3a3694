"""The run list of the detector calibration study: long healthy runs and the fault grid.

Healthy runs see a whole LR schedule (10,000 steps of the ``full`` preset's model):

- ``healthy-cosine-seed{1,2,3}``: warm-up 100 steps, cosine decay to LR/10 over 10,000 steps;
  seed 3 is interrupted half-way (``--exit-interval 5000``: save and exit) and resumed from its
  checkpoint with the detector state restored, as a job requeued by SLURM would be;
- ``healthy-wsd-seed4``: warmup-stable-decay, the last 2,000 steps a linear decay to LR/10;
- ``healthy-cosine-seed5``: one more cosine run, never a parent, added to the held-out set.

Fault runs fork from the healthy run of the same seed: the trainer is bit-identical when repeated
(docs/RESULTS.md, "Reproducibility"), so a fault run with onset ``T`` loads the healthy run's
checkpoint at ``T - delta`` (the first check that sees faulty steps, at ``T``, then has its
``t - delta`` snapshot) and its record before ``T`` is the healthy run's. This saves the
pre-onset steps of every fault run without changing a single number.

- ``fa-s{32,16}-on{500,2000}-seed{1,2,3}`` and ``fa-s8-on500-seed1``: the amplified FA fault at
  32 / 16 / 8 BF16 ulps; a run stops 300 steps after its loss divergence (or at its cap);
- ``moe-lr-seed{1,2,3}`` (4x LR on the whole model) and ``moe-router-lr-seed{1,2,3}`` (15x on
  the router only), from step 1 on the 10,000-step schedule, 1,500 steps each.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from mechmon_megatron.research.study.scenarios import PRESETS, Preset, get_scenario, trainer_flags

HEALTHY_ITERS = 10_000
WSD_DECAY_ITERS = 2_000
INTERRUPT_AT = 5_000
HEALTHY_SAVE_INTERVAL = 1_000
FAULT_SAVE_INTERVAL = 500
FAULT_SEEDS = (1, 2, 3)
FA_STRENGTHS = (32.0, 16.0)
FA_ONSETS = (500, 2_000)
FA_CAP_AFTER_ONSET = {32.0: 1_500, 16.0: 2_500, 8.0: 3_000}
STOP_AFTER_DIVERGENCE = 300
LR_FAULT_ITERS = 1_500


@dataclass(kw_only=True, frozen=True, slots=True)
class CampaignRun:
    """One run of the campaign. ``parent``/``fork_at``: start from the parent's checkpoint."""

    run_id: str
    kind: str
    """``healthy`` or ``fault``."""
    scenario: str
    seed: int
    train_iters: int
    flags: tuple[str, ...]
    fault_onset: Optional[int] = None
    fault_family: str = "none"
    schedule: str = "cosine"
    fa_strength: Optional[float] = None
    parent: Optional[str] = None
    fork_at: Optional[int] = None
    interrupt_at: Optional[int] = None
    """Save and exit once at this iteration, then resume (the resumed-run check)."""
    stop_after_divergence: Optional[int] = None
    """Stop this many steps after the loss divergence (a fault run has told its story)."""
    save_interval: int = HEALTHY_SAVE_INTERVAL
    save_at: tuple[int, ...] = field(default_factory=tuple)


def _set_flag(flags: list[str], name: str, value: str) -> list[str]:
    if name in flags:
        flags[flags.index(name) + 1] = value
    else:
        flags += [name, value]
    return flags


def _flags(preset: Preset, scenario: str, seed: int, train_iters: int, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    flags = list(trainer_flags(get_scenario(scenario), preset, seed, train_iters))
    _set_flag(flags, "--lr-decay-iters", str(HEALTHY_ITERS))  # every run follows the long schedule
    return tuple(flags) + tuple(extra)


def long_preset(base: str = "full") -> Preset:
    """The ``base`` preset's model and monitor schedule, on the 10,000-step LR schedule."""
    name = "long" if base == "full" else f"long-{base}"
    return replace(PRESETS[base], name=name, train_iters=HEALTHY_ITERS, lr_decay_iters=HEALTHY_ITERS)


def plan_campaign(preset: Optional[Preset] = None) -> list[CampaignRun]:
    """Every run, in launch order (healthy parents first within each seed)."""
    preset = preset or long_preset()
    delta = preset.mechmon_delta
    fork_points = tuple(onset - delta for onset in FA_ONSETS)
    healthy: dict[int, CampaignRun] = {}
    faults: dict[int, list[CampaignRun]] = {}
    for seed in FAULT_SEEDS:
        healthy[seed] = CampaignRun(
            run_id=f"healthy-cosine-seed{seed}", kind="healthy", scenario="clean", seed=seed,
            train_iters=HEALTHY_ITERS, flags=_flags(preset, "clean", seed, HEALTHY_ITERS),
            interrupt_at=INTERRUPT_AT if seed == 3 else None, save_at=fork_points,
        )
        faults[seed] = []
        strengths = FA_STRENGTHS + ((8.0,) if seed == 1 else ())
        for onset in FA_ONSETS:
            for strength in strengths:
                if strength == 8.0 and onset != 500:
                    continue
                cap = onset + FA_CAP_AFTER_ONSET[strength]
                extra = ("--fa-fault-strength", repr(strength), "--fa-fault-onset", str(onset),
                         "--fa-fault-mode", "all_rows")
                faults[seed].append(CampaignRun(
                    run_id=f"fa-s{int(strength)}-on{onset}-seed{seed}", kind="fault", scenario="fa", seed=seed,
                    train_iters=cap, flags=_flags(preset, "clean", seed, cap, extra), fault_onset=onset,
                    fault_family="attn", fa_strength=strength, parent=healthy[seed].run_id,
                    fork_at=onset - delta, stop_after_divergence=STOP_AFTER_DIVERGENCE,
                    save_interval=FAULT_SAVE_INTERVAL,
                ))
        for scenario in ("moe-router-lr", "moe-lr"):
            faults[seed].append(CampaignRun(
                run_id=f"{scenario}-seed{seed}", kind="fault", scenario=scenario, seed=seed,
                train_iters=LR_FAULT_ITERS, flags=_flags(preset, scenario, seed, LR_FAULT_ITERS), fault_onset=1,
                fault_family="router", save_interval=FAULT_SAVE_INTERVAL,
            ))
    wsd = ("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", str(WSD_DECAY_ITERS), "--lr-wsd-decay-style", "linear")
    wsd_run = CampaignRun(
        run_id="healthy-wsd-seed4", kind="healthy", scenario="clean", seed=4, train_iters=HEALTHY_ITERS,
        flags=_flags(preset, "clean", 4, HEALTHY_ITERS, wsd), schedule="wsd",
    )
    held_out = CampaignRun(
        run_id="healthy-cosine-seed5", kind="healthy", scenario="clean", seed=5, train_iters=HEALTHY_ITERS,
        flags=_flags(preset, "clean", 5, HEALTHY_ITERS),
    )
    # Long runs start early (they set the wall time); seeds 1-2's faults fill in once their
    # parents have passed the fork points.
    return [healthy[1], healthy[2], *faults[1], *faults[2], healthy[3], wsd_run, *faults[3], held_out]
