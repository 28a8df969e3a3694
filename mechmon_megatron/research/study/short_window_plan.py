"""The run list of the issue-19 short-window campaign: the detector study's runs, recorded with
``--mechmon-short-window`` (Delta2 over the last ``interval`` steps beside the ``delta``-step window).

Same model, schedule, seeds and fault injector as :mod:`~mechmon_megatron.research.study.long_plan`,
trained under the CPU pin of :mod:`~mechmon_megatron.research.reproducible_cpu` (the study runner
applies it). The committed detector-study records were trained before that pin on another CPU, so
these runs are a new realisation of the same runs (measured: the loss differs from step 1 at
~1e-7 relative), and both designs are compared on these runs only. Launch order (one job at a
time on the shared machine):

1. calibration: ``healthy-cosine-seed1``, ``-seed2`` (10,000 steps, checkpoints at the fork points
   400 and 1,900);
2. ``healthy-prefix-seed3``: the seed-3 healthy run up to 1,900 steps (only a parent: the fault
   forks need nothing later);
3. FA faults seeds 1-3 at 32 and 16 ulps, onset 500 (forks at 400), then onset 2,000 (forks at 1,900);
4. the second fault shape, reported beside the grid: the 32-ulp fault confined to one layer
   (``--fa-fault-layers 2``, onset 500, seeds 1-3, forks of the calibration / seed-3 parents);
5. held out: ``healthy-prefix-seed{4,5,6}`` and their FA faults (onset 500, then 2,000);
6. the learning-rate faults of the detector study, seeds 1-3 (router-only 15x and whole-model 4x
   LR from step 1, 1,500 steps): the attribution targets (a router alarm, never the precision
   mechanism) under the short window;
7. held out for a design changed after seeds 4-6 were seen (round 6): ``healthy-prefix-seed{7,8,9}``
   and their FA faults (onset 500, then 2,000). Added on 2026-12-02 before any of these runs
   existed; a design chosen on the choice runs is reported on them unchanged.
8. held out for round 7 (``long+logit5``, the per-step logit tail fitted on every 10,000-step
   healthy run that existed): ``healthy-cosine-seed{10,11,12}``, NEW 10,000-step healthy runs
   (the false-alarm test) that are also the parents of the FA faults of seeds 10-12 (onset 500,
   then 2,000; forks at 400 and 1,900, like the calibration seeds). Added on 2026-12-03 before any
   of these runs existed (:func:`round7_held_out_ids`).
9. held out for the shipped detector's false-alarm statement (session 12, after the round-7 runs
   showed a near miss and the leave-one-run-out check rejected the exponential tail):
   ``healthy-cosine-seed{13,14,15}``, NEW 10,000-step healthy runs, no forks. Added on 2026-12-03
   before any of these runs existed (:func:`round8_healthy_ids`); the shipped ``null_tails.json``
   is replayed on them unchanged (docs/RESULTS.md, "Healthy runs").
10. the grid's 8-ulp row on three seeds (issue 19 asks for 8 ulps on 3 seeds; the detector study
    has seed 1 only): ``fa-s8-on500-seed{10,11,12}``, forked at 400 from the round-7 healthy runs,
    capped at onset + 3,000 and stopped 300 steps after the loss diverges, like every FA fork.
    Added on 2026-12-04 (session 13) before any of these runs existed (:func:`s8_ids`); the shipped
    detector and the max-logit rule at 2.5 are replayed on them unchanged (docs/RESULTS.md).

Items 4 and 6 were added in round 5 before any of their runs started; they are reported, not part
of the choice. The launch order of 4-6 only decides what a session's time reaches first.
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

SHORT_FLAG = "--mechmon-short-window"
PROVISIONAL_CALIBRATION = "provisional_null_tails.json"
CALIBRATION_SEEDS = (1, 2)
CHOICE_SEEDS = (1, 2, 3)
"""Fault seeds the design is chosen on."""
HELD_OUT_SEEDS = (4, 5, 6)
"""Fault seeds reported unchanged after the design is frozen (pre-registered, docs/RESULTS.md)."""
SECOND_HELD_OUT_SEEDS = (7, 8, 9)
"""Fault seeds for a design changed after seeds 4-6 were looked at (round 6, docs/RESULTS.md)."""
THIRD_HELD_OUT_SEEDS = (10, 11, 12)
"""Round 7: fault seeds and new 10,000-step healthy runs for ``long+logit5`` (docs/RESULTS.md)."""
HEALTHY_CHECK_SEEDS = (13, 14, 15)
"""Item 9: new 10,000-step healthy runs on which the shipped detector is replayed unchanged."""
S8_SEEDS, S8_STRENGTH, S8_ONSET = THIRD_HELD_OUT_SEEDS, 8.0, 500
"""Item 10: the 8-ulp FA fault at onset 500 on three seeds (forks of the round-7 healthy runs)."""
STRENGTHS = (32.0, 16.0)
LR_SCENARIOS = ("moe-router-lr", "moe-lr")
"""Router-only 15x and whole-model 4x learning rate, as in the detector study (``long_plan``)."""
CONFINED_LAYERS = (2,)
"""The second fault shape: the fault acts in these global layer numbers only (``--fa-fault-layers``)."""
CONFINED_STRENGTH, CONFINED_ONSET = 32.0, 500


def write_provisional_calibration(out_dir: str) -> str:
    """``OUT/provisional_null_tails.json``: the shipped tails plus ``attn_delta2_short`` copied from
    ``attn_delta2`` at overlap 1 (the non-overlapping window's tail) under every overlap. For the
    recording runs' start-up only; returns its path."""
    table = load_tail_table()
    data = table.to_dict()
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


def plan_short_window_campaign(calibration_path: str, preset: Optional[Preset] = None) -> list[CampaignRun]:
    """Every run, in launch order (see the module docstring)."""
    preset = preset or long_preset()
    delta = preset.mechmon_delta
    fork_points = tuple(onset - delta for onset in FA_ONSETS)
    short = (SHORT_FLAG, "--mechmon-detector-calibration", calibration_path)

    def healthy(seed: int, iters: int, prefix: bool) -> CampaignRun:
        name = f"healthy-prefix-seed{seed}" if prefix else f"healthy-cosine-seed{seed}"
        return CampaignRun(run_id=name, kind="healthy", scenario="clean", seed=seed, train_iters=iters,
                           flags=_flags(preset, "clean", seed, iters, short), save_at=fork_points)

    def fault(parent: CampaignRun, strength: float, onset: int, layers: tuple[int, ...] = ()) -> CampaignRun:
        cap = onset + FA_CAP_AFTER_ONSET[strength]
        confined = ("--fa-fault-layers", ",".join(str(n) for n in layers)) if layers else ()
        extra = ("--fa-fault-strength", repr(strength), "--fa-fault-onset", str(onset), "--fa-fault-mode",
                 "all_rows", *confined, *short)
        shape = "-layers" + "-".join(str(n) for n in layers) if layers else ""
        return CampaignRun(
            run_id=f"fa-s{int(strength)}-on{onset}{shape}-seed{parent.seed}", kind="fault", scenario="fa",
            seed=parent.seed, train_iters=cap, flags=_flags(preset, "clean", parent.seed, cap, extra),
            fault_onset=onset, fault_family="attn", fa_strength=strength, parent=parent.run_id,
            fork_at=onset - delta, stop_after_divergence=STOP_AFTER_DIVERGENCE, save_interval=FAULT_SAVE_INTERVAL,
        )

    prefix_iters = max(fork_points)
    parents = {seed: healthy(seed, HEALTHY_ITERS, False) for seed in CALIBRATION_SEEDS}
    for seed in (3, *HELD_OUT_SEEDS, *SECOND_HELD_OUT_SEEDS):
        parents[seed] = healthy(seed, prefix_iters, True)
    for seed in (*THIRD_HELD_OUT_SEEDS, *HEALTHY_CHECK_SEEDS):  # full 10,000-step runs (held-out healthy)
        parents[seed] = healthy(seed, HEALTHY_ITERS, False)
    def lr_fault(scenario: str, seed: int) -> CampaignRun:
        return CampaignRun(
            run_id=f"{scenario}-seed{seed}", kind="fault", scenario=scenario, seed=seed, train_iters=LR_FAULT_ITERS,
            flags=_flags(preset, scenario, seed, LR_FAULT_ITERS, short), fault_onset=1, fault_family="router",
            save_interval=FAULT_SAVE_INTERVAL,
        )

    runs = [parents[1], parents[2], parents[3]]
    for onset in FA_ONSETS:
        runs += [fault(parents[s], strength, onset) for s in CHOICE_SEEDS for strength in STRENGTHS]
    runs += [fault(parents[s], CONFINED_STRENGTH, CONFINED_ONSET, CONFINED_LAYERS) for s in CHOICE_SEEDS]
    runs += [parents[s] for s in HELD_OUT_SEEDS]
    for onset in FA_ONSETS:
        runs += [fault(parents[s], strength, onset) for s in HELD_OUT_SEEDS for strength in STRENGTHS]
    runs += [lr_fault(scenario, s) for s in CHOICE_SEEDS for scenario in LR_SCENARIOS]
    runs += [parents[s] for s in SECOND_HELD_OUT_SEEDS]
    for onset in FA_ONSETS:
        runs += [fault(parents[s], strength, onset) for s in SECOND_HELD_OUT_SEEDS for strength in STRENGTHS]
    runs += [parents[s] for s in THIRD_HELD_OUT_SEEDS]
    for onset in FA_ONSETS:
        runs += [fault(parents[s], strength, onset) for s in THIRD_HELD_OUT_SEEDS for strength in STRENGTHS]
    runs += [parents[s] for s in HEALTHY_CHECK_SEEDS]
    runs += [fault(parents[s], S8_STRENGTH, S8_ONSET) for s in S8_SEEDS]
    return runs


def round7_held_out_ids(calibration_path: str = PROVISIONAL_CALIBRATION) -> list[str]:
    """The run ids of item 8 (round 7's held-out runs), in launch order: the three 10,000-step
    healthy runs, then their FA forks. ``--only`` for ``tools/detector_study.py run``."""
    seeds = {f"seed{s}" for s in THIRD_HELD_OUT_SEEDS}
    later = set(s8_ids())  # item 10 forks the same parents; it is not part of round 7
    return [r.run_id for r in plan_short_window_campaign(calibration_path)
            if r.run_id.rsplit("-", 1)[1] in seeds and r.run_id not in later]



def round8_healthy_ids() -> list[str]:
    """The run ids of item 9 (``--only`` for ``tools/detector_study.py run --plan short-window``)."""
    return [f"healthy-cosine-seed{s}" for s in HEALTHY_CHECK_SEEDS]


def s8_ids() -> list[str]:
    """The run ids of item 10 (``--only`` for ``tools/detector_study.py run --plan short-window``)."""
    return [f"fa-s{int(S8_STRENGTH)}-on{S8_ONSET}-seed{s}" for s in S8_SEEDS]
