"""Checkpoint discovery (Megatron iter_* + tracker, DeepSpeed tags + latest) and the rollback choice."""

from __future__ import annotations

from pathlib import Path

from mechmon_megatron.supervise.checkpoints import (
    Checkpoint,
    latest_checkpoint,
    list_checkpoints,
    select_rollback,
)


def _megatron(save: Path, iterations, tracker, incomplete=()):
    for it in iterations:
        (save / f"iter_{it:07d}").mkdir(parents=True)
        (save / f"iter_{it:07d}" / "metadata.json").write_text("{}")
    for it in incomplete:
        (save / f"iter_{it:07d}").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text(str(tracker))


def test_megatron_layout(tmp_path: Path):
    _megatron(tmp_path, [5, 10, 12, 15], tracker=12, incomplete=[8])
    found = list_checkpoints(str(tmp_path))
    # iter 8 has no files (a save that did not finish), 15 is newer than the tracker
    assert [c.iteration for c in found] == [5, 10, 12] and {c.layout for c in found} == {"megatron"}
    assert latest_checkpoint(str(tmp_path)).name == "iter_0000012"


def test_deepspeed_layout(tmp_path: Path):
    for step in (4, 8):
        (tmp_path / f"global_step{step}").mkdir()
        (tmp_path / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "global_step9").mkdir()  # nothing in it
    (tmp_path / "latest").write_text("global_step8")
    found = list_checkpoints(str(tmp_path))
    assert [(c.iteration, c.name, c.layout) for c in found] == [(4, "global_step4", "deepspeed"),
                                                                (8, "global_step8", "deepspeed")]
    assert latest_checkpoint(str(tmp_path)).name == "global_step8"
    assert list_checkpoints(str(tmp_path / "missing")) == []


def _ckpts(*iterations):
    return [Checkpoint(iteration=i, path=f"/s/iter_{i:07d}", name=f"iter_{i:07d}", layout="megatron")
            for i in iterations]


def test_select_newest_at_or_before_the_change_point():
    choice = select_rollback(_ckpts(5, 10, 15, 20), change_point=15, alarm_iteration=20)
    assert choice.checkpoint.iteration == 15 and not choice.after_change_point
    choice = select_rollback(_ckpts(5, 10, 15, 20), change_point=14, alarm_iteration=20)
    assert choice.checkpoint.iteration == 10


def test_the_abort_checkpoint_is_never_the_rollback():
    # a drill: change point = alarm iteration = the abort checkpoint's
    choice = select_rollback(_ckpts(5, 10, 12), change_point=12, alarm_iteration=12)
    assert choice.checkpoint.iteration == 10


def test_after_the_change_point_is_said():
    choice = select_rollback(_ckpts(10, 15, 20), change_point=7, alarm_iteration=20)
    assert choice.checkpoint.iteration == 10 and choice.after_change_point and "AFTER" in choice.why
    none = select_rollback(_ckpts(20), change_point=7, alarm_iteration=20)
    assert none.checkpoint is None and "no finished checkpoint" in none.why
