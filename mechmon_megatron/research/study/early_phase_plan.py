"""The run list of the early-phase study: held-out runs for a detector that is as early at step 500
as at step 5,000 (pre-registered in docs/METHOD.md section 8c).

Every run is new (seeds 16-21 were never trained before this plan was written) and held out: a
design is chosen on the committed records of seeds 1-15 only, frozen in a commit, and then
replayed on these records unchanged. Same model, schedule and fault injector as the detector
study (:mod:`~mechmon_megatron.research.study.long_plan`, the ``full`` preset on the 10,000-step
cosine schedule), recorded at interval 20 and delta 100 with ``--mechmon-short-window`` (so a
design may use the short window) and ``--mechmon-action log`` (the records are what counts; the
online alarms of a provisional calibration do not). Launch order, so that a session's time
reaches the fault forks first:

1. ``healthy-prefix-seed{19,20,21}``: 1,900-step healthy runs, the parents of their seeds' forks;
2. their FA forks: 32 and 16 BF16 ulps at onset 500 (forks at 400), then at onset 2,000 (forks at
   1,900); each stops 300 steps after its loss divergence or at its cap;
3. ``healthy-cosine-seed{16,17,18}``: new 10,000-step healthy runs (the false-alarm test at
   intervals 20 and 100), parents of their seeds' forks;
4. their FA forks (as in 2), then the 8-ulp fault at onset 500 on seeds 16-18;
5. router-only 15x and whole-model 4x learning-rate faults, seeds 16-18 (1,500 steps from step 1).

:func:`plan_learning_rate_campaign` is the second held-out set (``--plan early-phase-lr``): the
same two learning-rate faults on new seeds 22-27, for the design that keys the phase moments by
the peak learning rate (docs/METHOD.md section 8c, second amendment).

Pure Python: no torch import.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from mechmon_megatron.detect.null_model import load_tail_table
from mechmon_megatron.research.study.long_plan import (
    FA_CAP_AFTER_ONSET,
    FA_ONSETS,
    FAULT_SAVE_INTERVAL,
    HEALTHY_ITERS,
    LR_FAULT_ITERS,
    STOP_AFTER_DIVERGENCE,
    CampaignRun,
    _flags,
    long_preset,
)
from mechmon_megatron.research.study.scenarios import Preset

PREFIX_SEEDS = (19, 20, 21)
"""Held-out fault seeds whose healthy parent stops at the last fork point (1,900 steps)."""
LONG_SEEDS = (16, 17, 18)
"""Held-out seeds with a whole 10,000-step healthy run (also the false-alarm test)."""
STRENGTHS = (32.0, 16.0)
S8_STRENGTH, S8_ONSET = 8.0, 500
LR_SCENARIOS = ("moe-router-lr", "moe-lr")
LR_HELD_OUT_SEEDS = (22, 23, 24, 25, 26, 27)
"""Seeds of the second held-out set: learning-rate faults only, never trained before it was written."""
PROVISIONAL_CALIBRATION = "provisional_null_tails.json"


def write_provisional_calibration(out_dir: str) -> str:
    """``OUT/provisional_null_tails.json``: the shipped tails plus ``attn_delta2_short`` copied from
    ``attn_delta2`` at overlap 1, so that the recording runs may start with the short window. Not
    a measurement (it says so in its ``source``); returns its absolute path."""
    data = load_tail_table().to_dict()
    source = data["tails"]["1"]["attn_delta2"]
    for overlap in data["tails"]:
        data["tails"][overlap]["attn_delta2_short"] = source
    data["source"] = ("PROVISIONAL, recording runs only (--mechmon-action log): the shipped table with "
                      "attn_delta2_short copied from attn_delta2 at overlap 1; not a measurement")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PROVISIONAL_CALIBRATION)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    return os.path.abspath(path)


def plan_early_phase_campaign(calibration_path: str, preset: Optional[Preset] = None) -> list[CampaignRun]:
    """Every run, in launch order (module docstring). ``calibration_path``: the provisional table
    the recording runs start with (:func:`write_provisional_calibration`)."""
    preset = preset or long_preset()
    delta = preset.mechmon_delta
    fork_points = tuple(onset - delta for onset in FA_ONSETS)
    recording = ("--mechmon-short-window", "--mechmon-detector-calibration", calibration_path)

    def healthy(seed: int, iters: int) -> CampaignRun:
        name = f"healthy-cosine-seed{seed}" if iters == HEALTHY_ITERS else f"healthy-prefix-seed{seed}"
        return CampaignRun(run_id=name, kind="healthy", scenario="clean", seed=seed, train_iters=iters,
                           flags=_flags(preset, "clean", seed, iters, recording), save_at=fork_points)

    def fault(parent: CampaignRun, strength: float, onset: int) -> CampaignRun:
        cap = onset + FA_CAP_AFTER_ONSET[strength]
        extra = ("--fa-fault-strength", repr(strength), "--fa-fault-onset", str(onset), "--fa-fault-mode",
                 "all_rows", *recording)
        return CampaignRun(
            run_id=f"fa-s{int(strength)}-on{onset}-seed{parent.seed}", kind="fault", scenario="fa",
            seed=parent.seed, train_iters=cap, flags=_flags(preset, "clean", parent.seed, cap, extra),
            fault_onset=onset, fault_family="attn", fa_strength=strength, parent=parent.run_id,
            fork_at=onset - delta, stop_after_divergence=STOP_AFTER_DIVERGENCE, save_interval=FAULT_SAVE_INTERVAL,
        )

    parents = {seed: healthy(seed, max(fork_points)) for seed in PREFIX_SEEDS}
    parents.update({seed: healthy(seed, HEALTHY_ITERS) for seed in LONG_SEEDS})
    runs = [parents[s] for s in PREFIX_SEEDS]
    for onset in FA_ONSETS:
        runs += [fault(parents[s], strength, onset) for s in PREFIX_SEEDS for strength in STRENGTHS]
    runs += [parents[s] for s in LONG_SEEDS]
    for onset in FA_ONSETS:
        runs += [fault(parents[s], strength, onset) for s in LONG_SEEDS for strength in STRENGTHS]
    runs += [fault(parents[s], S8_STRENGTH, S8_ONSET) for s in LONG_SEEDS]
    runs += [_lr_fault(preset, scenario, s, recording) for s in LONG_SEEDS for scenario in LR_SCENARIOS]
    return runs


def plan_learning_rate_campaign(calibration_path: str, preset: Optional[Preset] = None) -> list[CampaignRun]:
    """The second held-out set: router-only 15x and whole-model 4x learning-rate faults on seeds
    :data:`LR_HELD_OUT_SEEDS`, recorded as the first set's (``calibration_path`` as there)."""
    preset = preset or long_preset()
    recording = ("--mechmon-short-window", "--mechmon-detector-calibration", calibration_path)
    return [_lr_fault(preset, scenario, s, recording) for s in LR_HELD_OUT_SEEDS for scenario in LR_SCENARIOS]


def _lr_fault(preset: Preset, scenario: str, seed: int, recording: tuple[str, ...]) -> CampaignRun:
    """One learning-rate fault from step 1: 1,500 steps, recorded at interval 20 and delta 100."""
    return CampaignRun(
        run_id=f"{scenario}-seed{seed}", kind="fault", scenario=scenario, seed=seed, train_iters=LR_FAULT_ITERS,
        flags=_flags(preset, scenario, seed, LR_FAULT_ITERS, recording), fault_onset=1, fault_family="router",
        save_interval=FAULT_SAVE_INTERVAL,
    )
