"""Each run of a study plan records its own learning-rate schedule (``study.run_schedule``): the
``moe-lr`` fault's peak learning rate is its own, so the early-phase correction (keyed by it) is off
there in the replays, as in the trainer; a plan written before runs recorded theirs is read as before."""

from __future__ import annotations

from mechmon_megatron.detect.phase_moments import TrainingSchedule
from mechmon_megatron.research.study.scenarios import get_preset, plan_runs, schedule_of_flags
from mechmon_megatron.research.study.study import _spec_json, run_schedule


def test_every_run_records_the_schedule_of_its_own_flags():
    preset = get_preset("demo")
    specs = {s.scenario: s for s in plan_runs(("clean", "fa", "moe-lr"), (1,), preset, preset.train_iters, None)}
    plan = {"runs": [_spec_json(s, None) for s in specs.values()]}
    got = {e["scenario"]: run_schedule(plan, e) for e in plan["runs"]}
    warmup = schedule_of_flags(preset.model_flags).lr_warmup_steps
    assert got["clean"] == got["fa"] == TrainingSchedule(warmup, "cosine", preset.base_lr)
    assert got["moe-lr"] == TrainingSchedule(warmup, "cosine", preset.high_lr) and preset.high_lr != preset.base_lr


def test_a_plan_of_the_first_design_holds_one_schedule_without_a_peak_learning_rate():
    old = {"lr_schedule": {"lr_warmup_steps": 100, "lr_decay_style": "cosine"}, "runs": [{"run_id": "fa-seed1"}]}
    assert run_schedule(old, old["runs"][0]) == TrainingSchedule(100, "cosine")
    assert run_schedule({"runs": [{}]}, {}) is None  # older still: no schedule, no correction


def test_the_flags_default_to_the_example_trainers():
    from gpt_trainer.args import build_parser

    defaults = build_parser().parse_args([])
    assert schedule_of_flags([]) == TrainingSchedule(defaults.lr_warmup_iters, defaults.lr_decay_style, defaults.lr)
    assert schedule_of_flags(["--lr", "3e-4", "--lr-warmup-iters", "7"]) == TrainingSchedule(7, "cosine", 3e-4)
