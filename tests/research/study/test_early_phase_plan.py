"""The early-phase study's held-out run list (docs/METHOD.md section 8c): new seeds only, every
fork after its parent, the grid the pre-registration names."""

from __future__ import annotations

import json

from mechmon_megatron.research.study.early_phase_plan import (
    LONG_SEEDS,
    LR_HELD_OUT_SEEDS,
    LR_SCENARIOS,
    PREFIX_SEEDS,
    plan_early_phase_campaign,
    plan_learning_rate_campaign,
    write_provisional_calibration,
)

DESIGN_SEEDS = set(range(1, 16))
"""Seeds of the committed records a design may be chosen on."""


def test_the_held_out_seeds_are_new_and_every_fork_follows_its_parent(tmp_path):
    runs = plan_early_phase_campaign(write_provisional_calibration(str(tmp_path)))
    ids = [r.run_id for r in runs]
    assert len(ids) == len(set(ids))
    assert not {r.seed for r in runs} & DESIGN_SEEDS
    position = {run_id: i for i, run_id in enumerate(ids)}
    by_id = {r.run_id: r for r in runs}
    for run in runs:
        if run.parent is not None:
            parent = by_id[run.parent]
            assert position[run.parent] < position[run.run_id]
            assert run.fork_at in parent.save_at and run.fork_at == run.fault_onset - 100
        assert "--mechmon-short-window" in run.flags and "log" in run.flags


def test_the_grid_is_the_pre_registered_one(tmp_path):
    runs = plan_early_phase_campaign(write_provisional_calibration(str(tmp_path)))
    fa = {(r.fa_strength, r.fault_onset, r.seed) for r in runs if r.scenario == "fa"}
    seeds = (*PREFIX_SEEDS, *LONG_SEEDS)
    assert {(s, o, seed) for s in (32.0, 16.0) for o in (500, 2000) for seed in seeds} <= fa
    assert {(8.0, 500, seed) for seed in LONG_SEEDS} <= fa and len(fa) == 4 * len(seeds) + len(LONG_SEEDS)
    lr = {(r.scenario, r.seed) for r in runs if r.fault_family == "router"}
    assert lr == {(sc, seed) for sc in ("moe-router-lr", "moe-lr") for seed in LONG_SEEDS}
    healthy = {r.run_id: r.train_iters for r in runs if r.kind == "healthy"}
    assert {healthy[f"healthy-cosine-seed{s}"] for s in LONG_SEEDS} == {10_000}
    assert {healthy[f"healthy-prefix-seed{s}"] for s in PREFIX_SEEDS} == {1_900}


def test_the_provisional_calibration_says_it_is_no_measurement(tmp_path):
    path = write_provisional_calibration(str(tmp_path))
    data = json.loads(open(path, encoding="utf-8").read())
    assert data["source"].startswith("PROVISIONAL")
    assert all("attn_delta2_short" in tails for tails in data["tails"].values())


def test_the_second_held_out_set_is_new_seeds_of_both_learning_rate_faults(tmp_path):
    first = plan_early_phase_campaign(write_provisional_calibration(str(tmp_path)))
    second = plan_learning_rate_campaign(write_provisional_calibration(str(tmp_path)))
    assert {(r.scenario, r.seed) for r in second} == {(sc, s) for sc in LR_SCENARIOS for s in LR_HELD_OUT_SEEDS}
    assert not {r.seed for r in second} & (DESIGN_SEEDS | {r.seed for r in first})
    same_recipe = {r.scenario: r for r in first if r.fault_family == "router"}
    for run in second:  # the first set's recording, only the seed differs
        twin = same_recipe[run.scenario]
        assert run.train_iters == twin.train_iters and run.fault_onset == twin.fault_onset == 1
        assert [f for f in run.flags if f != str(run.seed)] == [f for f in twin.flags if f != str(twin.seed)]
