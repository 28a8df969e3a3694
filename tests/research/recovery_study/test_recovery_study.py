"""The recovery study's bookkeeping (pure): kept trajectory, resume point, the practice operator's
rule watcher and restart, cells, the table. The training runs themselves: tools/recovery_study.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mechmon_megatron.research.recovery_study.campaign import Cell, _flags, clean_dir, parse_cell
from mechmon_megatron.research.recovery_study.launch import LaunchRecord, LaunchState, _resume_point, kept_trajectory
from mechmon_megatron.research.recovery_study.operators import (
    _restart_after_spike,
    _Watcher,
    practice_rules,
    without_mechmon,
)
from mechmon_megatron.research.recovery_study.table import markdown_table
from mechmon_megatron.supervise.command import flag_values, parse_command


def _write_rows(path: str, rows: list[tuple[int, float]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for i, loss in rows:
            f.write(json.dumps({"iteration": i, "lm_loss": loss, "step_time_s": 0.1}) + "\n")


def _ckpt(save: Path, iteration: int) -> None:
    folder = save / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metadata.json").write_text("{}")
    (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_kept_trajectory_drops_what_a_rollback_discarded(tmp_path: Path):
    state = LaunchState(str(tmp_path))
    first = LaunchRecord(index=1, argv=[], start_iteration=0, started=0.0, finished=True)
    second = LaunchRecord(index=2, argv=[], start_iteration=3, started=0.0, finished=True)
    state.launches = [first, second]
    _write_rows(first.metrics_path(str(tmp_path)), [(i, 1.0) for i in range(1, 7)])
    # the second launch resumed once: iteration 5 written twice, the last row wins
    _write_rows(second.metrics_path(str(tmp_path)), [(4, 2.0), (5, 2.5), (5, 2.0), (8, 2.0)])
    kept = kept_trajectory(state)
    assert list(kept) == [1, 2, 3, 4, 5, 8]  # 6 of the first launch is gone; 6, 7 skipped by the second
    assert [kept[i]["lm_loss"] for i in (3, 4, 5)] == [1.0, 2.0, 2.0]


def test_a_resumed_launch_continues_from_its_own_newest_checkpoint(tmp_path: Path):
    save = tmp_path / "ck"
    _ckpt(save, 400)  # the fork, older than the launch
    _ckpt(save, 600)  # an abandoned launch's save, also older
    time.sleep(0.05)
    launch = LaunchRecord(index=2, argv=[], start_iteration=500, started=time.time(), finished=False)
    assert _resume_point(str(save), launch) is None
    time.sleep(0.05)
    _ckpt(save, 600)  # rewritten by this launch
    os.utime(save / "iter_0000600" / "metadata.json")
    _ckpt(save, 700)
    assert _resume_point(str(save), launch) == 700


def test_watcher_fires_on_the_foundry_rule_and_the_restart_skips_the_window(tmp_path: Path):
    directory = str(tmp_path)
    launch = LaunchRecord(index=1, argv=[], start_iteration=400, started=0.0)
    watcher = _Watcher(practice_rules(), directory, last=400)
    _write_rows(launch.metrics_path(directory), [(i, 2.0) for i in range(401, 551)])
    assert watcher(launch) is None  # healthy: neither rule
    _write_rows(launch.metrics_path(directory), [(i, 5.0) for i in range(551, 561)])
    step = watcher(launch)
    assert step == 555 and watcher.fired == "foundry_spike"  # 2x the mean for more than 4 steps
    save = tmp_path / "ck"
    for i in (400, 500):
        _ckpt(save, i)
    argv = ["python", "-m", "gpt_trainer", "--lr", "1e-3", "--save", str(save), "--load", str(save),
            "--ckpt-step", "400"]
    state = LaunchState(directory, [launch])
    state.extra["practice"] = {"restarts": 0, "spikes": [], "argv": argv, "skip": [], "handled": 0}
    launch.stopped_at, launch.note, launch.finished = step, "stopped by foundry_spike;", True
    _restart_after_spike(state, launch, str(save), fork=400)
    practice = state.extra["practice"]
    host = parse_command(practice["argv"]).host_args
    assert flag_values(host, "--ckpt-step") == ["400"]  # newest at or before 555 - 100
    assert flag_values(host, "--iterations-to-skip") == [str(i) for i in range(401, 556)]
    assert practice["restarts"] == 1 and practice["rollbacks"][0] == {"spike": 555, "rule": "foundry_spike",
                                                                      "to": 400, "skipped": [401, 555]}


def test_practice_runs_without_the_monitor():
    argv = ["python", "-m", "gpt_trainer", "--mechmon", "--mechmon-interval", "20", "--lr", "1e-3",
            "--mechmon-per-head-scalars", "--save", "s"]
    assert parse_command(without_mechmon(argv)).host_args == ["--lr", "1e-3", "--save", "s"]


def test_cells():
    assert parse_cell("fa:32:500:1") == Cell("fa", 1, 32.0, 500) and parse_cell("fa:32:500:1").fork == 400
    assert parse_cell("moe-lr:2").cell_id == "moe-lr-seed2" and parse_cell("moe-lr:2").fork == 0
    late = parse_cell("fa:16:2000:1")  # a later onset trains longer: the same 1,000 steps for the fault
    assert (late.fork, late.train_iters, parse_cell("fa:32:500:1").train_iters) == (1900, 3000, 1500)
    assert clean_dir("o", late).endswith("clean-seed1-3000") and clean_dir("o", parse_cell("moe-lr:1")).endswith(
        "clean-seed1")
    flags = _flags(late, "fa")
    assert flags[flags.index("--lr-decay-iters") + 1] == "3000" and flags[flags.index("--fa-fault-onset") + 1] == "2000"
    with pytest.raises(ValueError, match="multiple of the save interval"):
        parse_cell("fa:16:2050:1")
    with pytest.raises(ValueError, match="fa:STRENGTH:ONSET:SEED"):
        parse_cell("fa:32:1")


def test_table_says_which_cells_ran():
    done = {"status": "done", "restarts": 1, "steps_discarded": 60, "extra_wall_s": 12.0, "cause_removed": "yes",
            "loss_smoothed": 2.02, "loss_vs_clean": 0.01, "alarms": [], "divergence_step": None,
            "recovery": [{"action": "relaunch", "alert": {"family": "attn_delta2", "iteration": 660,
                                                          "first_warning_step": 560},
                          "checkpoint": {"name": "iter_0000500"}, "after_change_point": False,
                          "remedy": "fp32-attention-output"}], "recovered": True}
    record = {"cell": "fa-s32-on500-seed1", "clean_loss_smoothed": 2.0,
              "operators": {"none": {"status": "not run"}, "mechmon": done,
                            "practice": {"status": "unfinished", "restarts": 1, "last_step": 777, "spikes": [
                                {"spike": 690, "rule": "foundry_spike", "to": 500, "skipped": [501, 690]}]}}}
    table = markdown_table([record])
    assert "| fa-s32-on500-seed1 | none | not run |" in table
    assert "| practice | unfinished: 1 so far |" in table and "foundry_spike at 690 -> 500, skip 501-690" in table
    assert "reached step 777" in table
    assert "attn_delta2 alarm 660 (cp 560) -> iter_0000500, fp32-attention-output" in table
    assert "+1.0 %" in table and "met on 1 of the 1 mechmon runs that finished" in table


def test_demo_row_reads_the_records_and_the_losses(tmp_path: Path):
    from mechmon_megatron.research.recovery_study.demo_recovery import recovered_row

    metrics, clean = tmp_path / "m.jsonl", tmp_path / "c.jsonl"
    _write_rows(str(clean), [(i, 2.0) for i in range(1, 201)])
    _write_rows(str(metrics), [(i, 3.0) for i in range(1, 151)] + [(i, 2.02) for i in range(101, 201)])
    record = {"action": "relaunch", "alert": {"family": "attn_dw", "iteration": 150, "first_warning_step": 110,
                                              "layers": [1], "heads": [2, 0]},
              "checkpoint": {"name": "iter_0000100"}, "after_change_point": False, "remedy": "fp32-attention-output",
              "flags_added": ["--attention-backend torch", "--load ck", "--ckpt-step 100"],
              "flags_removed": ["--attention-backend emulated-lowp-fa", "--fa-fault-strength 32"]}
    result = {"records": [record, {"action": "stop"}], "train_iters": 200, "metrics": str(metrics),
              "returncode": 0, "wall_s": 1.0, "directory": str(tmp_path)}
    row = recovered_row(result, str(clean))[2]
    assert "attn_dw layer 1 heads 2,0 at 150 (110)" in row and "iter_0000100" in row
    assert "fp32-attention-output: set --attention-backend torch; dropped --fa-fault-strength 32 |" in row
    assert "--load" not in row and "emulated" not in row and "| 2.020 | 2.000 | +1.0 % |" in row


def test_records_name_no_machine_folder_whether_out_was_given_relative_or_absolute(tmp_path: Path, monkeypatch):
    from mechmon_megatron.research.recovery_study.campaign import write_record

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    record = {"cell": "fa-s32-on500-seed1",
              "paths": ["runs/fa-s32-on500-seed1/mechmon/ck/iter_0000500",
                        str(tmp_path / "runs" / "fa-s32-on500-seed1" / "mechmon" / "ck" / "iter_0000760")]}
    path = write_record(record, str(tmp_path / "records"), "runs")
    text = Path(path).read_text()
    assert str(tmp_path) not in text and "runs/" not in text
    assert json.loads(text)["paths"] == ["<out>/fa-s32-on500-seed1/mechmon/ck/iter_0000500",
                                         "<out>/fa-s32-on500-seed1/mechmon/ck/iter_0000760"]


def test_an_operator_rerun_alone_joins_the_earlier_record_of_its_cell(tmp_path: Path):
    from mechmon_megatron.research.recovery_study.campaign import write_record

    earlier = {"cell": "moe-lr-seed1", "clean_loss_smoothed": 1.48,
               "operators": {"none": {"status": "done", "loss_smoothed": 1.9}, "practice": {"status": "done"},
                             "mechmon": {"status": "done", "restarts": 2}}}
    write_record(earlier, str(tmp_path))
    rerun = {"cell": "moe-lr-seed1", "clean_loss_smoothed": None,
             "operators": {"none": {"status": "not run"}, "practice": {"status": "not run"},
                           "mechmon": {"status": "done", "restarts": 1}}}
    merged = json.loads(Path(write_record(rerun, str(tmp_path))).read_text())
    assert merged["operators"]["mechmon"]["restarts"] == 1  # the new run wins where it ran
    assert merged["operators"]["none"]["loss_smoothed"] == 1.9 and merged["clean_loss_smoothed"] == 1.48
    assert merged["operators_from_earlier_record"] == ["none", "practice"]
    other = {"cell": "moe-lr-seed2", "clean_loss_smoothed": None, "operators": {"none": {"status": "not run"}}}
    assert json.loads(Path(write_record(other, str(tmp_path))).read_text())["operators"]["none"] == {
        "status": "not run"}  # another cell's record is never read


def test_records_say_which_stack_and_cpu_made_them():
    import platform

    from mechmon_megatron.research.recovery_study.campaign import environment
    from mechmon_megatron.research.reproducible_cpu import PINNED_CPU_SETTINGS

    env = environment()
    assert env["python"] == platform.python_version() and env["torch"] and env["cpu"]
    assert env["pinned"] == PINNED_CPU_SETTINGS
