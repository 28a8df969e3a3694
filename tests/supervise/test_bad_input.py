"""The supervisor as a real process around a stand-in host (``_fake_host.py``): the loop's
decisions and every bad input -- a clear line, a record, at most M restarts, nothing deleted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.supervise._helpers import FAKE_HOST, REPO_ROOT, records, supervise, tree


def _host(save: Path, *flags: str) -> list[str]:
    return [sys.executable, str(FAKE_HOST), "--save", str(save), "--first-warning", "10", *flags]


def _launches(save: Path) -> list[list[str]]:
    path = save / "launches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_alarm_then_success_relaunches_once_from_the_change_point(tmp_path: Path):
    save = tmp_path / "ck"
    out = supervise([], _host(save, "--plan", "alarm,ok", "--lr", "0.004"))
    assert out.returncode == 0, out.output
    relaunch, done = records(save)
    assert relaunch["action"] == "relaunch" and relaunch["exit_code"] == 42 and relaunch["restarts"] == 1
    assert relaunch["checkpoint"]["name"] == "iter_0000010" and not relaunch["after_change_point"]
    assert relaunch["alert"]["family"] == "attn_delta2" and relaunch["alert"]["first_warning_step"] == 10
    assert relaunch["remedy"] == "fp32-attention-output"
    assert relaunch["flags_added"] == ["--fa-fp32-o", f"--load {save}", "--ckpt-step 10"]
    assert done["action"] == "stop" and done["exit_code"] == 0
    second = _launches(save)[1]
    assert second[-5:] == ["--fa-fp32-o", "--load", str(save), "--ckpt-step", "10"]
    assert "[mechmon-supervise] RELAUNCH after launch 1 (exit 42)" in out.output
    assert "no --save-interval" in out.output and "does not set --mechmon" in out.output  # start-up notices


def test_deepspeed_tags_are_selected_with_the_scripts_tag_flag(tmp_path: Path):
    save = tmp_path / "ck"
    out = supervise(["--select-flag=--ckpt-tag"], _host(save, "--plan", "alarm,ok", "--layout", "deepspeed"))
    assert out.returncode == 0, out.output
    relaunch = records(save)[0]
    assert relaunch["checkpoint"]["name"] == "global_step10" and relaunch["checkpoint"]["layout"] == "deepspeed"
    assert relaunch["flags_added"][-1] == "--ckpt-tag global_step10"
    assert (save / "latest").read_text() == "global_step12"  # read, never rewritten


def test_records_also_go_to_tensorboard_as_text(tmp_path: Path):
    save, tb = tmp_path / "ck", tmp_path / "tb"
    out = supervise([], _host(save, "--plan", "alarm,ok", "--tensorboard-dir", str(tb)))
    assert out.returncode == 0, out.output
    events = list(tb.glob("events.out.tfevents.*mechmon_recovery"))
    assert events and all(b"mechmon/recovery" in e.read_bytes() for e in events)


def test_same_family_again_escalates_then_stops_when_the_list_is_exhausted(tmp_path: Path):
    save = tmp_path / "ck"
    out = supervise(["--max-restarts", "5"], _host(save, "--plan", "alarm"))
    assert out.returncode == 42, out.output
    recs = records(save)
    assert [r["action"] for r in recs] == ["relaunch", "relaunch", "stop"]
    assert [r["remedy"] for r in recs[:2]] == ["fp32-attention-output", "tie-shift-or-local-attention"]
    assert "every attention_precision remedy tried" in recs[-1]["reason"]
    # the relaunch from iter_0000010 alarmed again: the next rollback is one save further back
    assert [r["checkpoint"]["name"] for r in recs[:2]] == ["iter_0000010", "iter_0000005"]
    assert "older than the last rollback point (10)" in recs[1]["why"] and not recs[1]["after_change_point"]
    assert len(_launches(save)) == 3
    assert {"iter_0000005", "iter_0000010", "iter_0000012"} <= set(os.listdir(save))  # nothing deleted


def test_max_restarts_bounds_the_loop(tmp_path: Path):
    save = tmp_path / "ck"
    # --window 0: every alarm is a new episode (first remedy again); only M stops the loop
    host = _host(save, "--plan", "alarm", "--family", "router_entropy", "--lr", "0.01")
    out = supervise(["--max-restarts", "2", "--window", "0"], host)
    assert out.returncode == 42, out.output
    recs = records(save)
    assert [r["action"] for r in recs] == ["relaunch", "relaunch", "stop"]
    assert "2 restarts done" in recs[-1]["reason"] and len(_launches(save)) == 3
    assert _launches(save)[2][_launches(save)[2].index("--lr") + 1] == "0.0025"  # halved twice


def test_policy_flag_the_host_lacks_stops_before_any_launch(tmp_path: Path):
    save, policy = tmp_path / "ck", tmp_path / "policy.json"
    policy.write_text(json.dumps({"version": 1, "families": {"attn_delta2": "a"}, "remedies": {
        "a": [{"name": "clip", "alternatives": [{"set": {"--qk-clip": True}}]}]}}))
    out = supervise(["--policy", policy], _host(save, "--plan", "alarm"))
    assert out.returncode == 2 and "--qk-clip" in out.output and str(policy) in out.output
    assert "Traceback" not in out.output and _launches(save) == []
    (stop,) = records(save)
    assert stop["action"] == "stop" and stop["launch"] == 0 and "--qk-clip" in stop["reason"]


def test_remedy_that_fails_at_start_up_stops(tmp_path: Path):
    save, policy = tmp_path / "ck", tmp_path / "policy.json"
    policy.write_text(json.dumps({"version": 1, "families": {"attn_delta2": "a"}, "remedies": {
        "a": [{"name": "bad-lr", "alternatives": [{"set": {"--lr": "abc"}}]}]}}))
    out = supervise(["--policy", policy, "--max-restarts", "3"], _host(save, "--plan", "alarm"))
    assert out.returncode == 2, out.output  # the host's parser: invalid float value
    recs = records(save)
    assert [r["action"] for r in recs] == ["relaunch", "stop"] and recs[-1]["exit_code"] == 2
    assert "not a mechmon abort" in recs[-1]["reason"] and "invalid float value: 'abc'" in out.output
    assert len(_launches(save)) == 1  # the relaunch failed in its parser, before it logged anything


def test_corrupt_foreign_missing_and_stale_alerts(tmp_path: Path):
    for outcome, match in (("corrupt", "is corrupt"), ("other", "from another run: its checkpoint_dir"),
                           ("noalert", "no mechmon_alert.json")):
        save = tmp_path / outcome
        out = supervise([], _host(save, "--plan", outcome))
        assert out.returncode == 42, out.output
        (stop,) = records(save)
        assert stop["action"] == "stop" and match in stop["reason"], stop
    # an alert left by an earlier run, older than this launch
    save = tmp_path / "stale"
    (save / "iter_0000012").mkdir(parents=True)
    alert = save / "iter_0000012" / "mechmon_alert.json"
    alert.write_text(json.dumps({"iteration": 12, "family": "attn_dw", "checkpoint_dir": str(alert.parent)}))
    os.utime(alert, (time.time() - 3600, time.time() - 3600))
    out = supervise([], _host(save, "--plan", "noalert"))
    assert out.returncode == 42 and "written before this launch" in records(save)[-1]["reason"], out.output


def _megatron_save(folder: Path, iteration: int) -> None:
    (folder / f"iter_{iteration:07d}").mkdir(parents=True)
    (folder / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")
    (folder / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_missing_checkpoint_and_after_change_point(tmp_path: Path):
    save, pretrained = tmp_path / "none", tmp_path / "pretrained"
    _megatron_save(pretrained, 11)  # the first launch resumes 11 (its tracker): after the change point 10
    out = supervise([], _host(save, "--plan", "alarm", "--load", str(pretrained)))  # no 5, 10: only 12
    assert out.returncode == 42 and "no finished checkpoint before the alarm" in records(save)[-1]["reason"]
    save = tmp_path / "late"  # started from a checkpoint at 4, after the change point 3
    out = supervise([], [*_host(save, "--plan", "alarm,ok", "--load", str(tmp_path / "pretrained"), "--ckpt-step",
                                "4"), "--first-warning", "3"])
    assert out.returncode == 0, out.output
    relaunch = records(save)[0]
    assert relaunch["checkpoint"]["name"] == "iter_0000005" and relaunch["after_change_point"] is True
    assert "saved AFTER the change point" in out.output


def test_change_point_before_every_save_goes_back_to_the_commands_start(tmp_path: Path):
    """An alarm whose drift may predate every save (the routing-entropy floor in the detector's
    warm-up: change point 0): the command's own start is at or before it, the saves are not."""
    save = tmp_path / "ck"
    out = supervise([], [*_host(save, "--plan", "alarm,ok", "--family", "router_entropy", "--lr", "0.008"),
                         "--first-warning", "0"])
    assert out.returncode == 0, out.output
    relaunch = records(save)[0]
    assert relaunch["checkpoint"]["name"] == "start" and relaunch["after_change_point"] is False
    assert "the command's own start (iteration 0) is" in relaunch["why"]
    second = _launches(save)[1]
    assert "--load" not in second and second[second.index("--lr") + 1] == "0.004"


def test_crash_and_nonfinite_are_not_relaunched(tmp_path: Path):
    save = tmp_path / "crash"
    out = supervise([], _host(save, "--plan", "crash"))
    assert out.returncode == 3 and "not a mechmon abort" in records(save)[-1]["reason"]
    save = tmp_path / "nonfinite"
    out = supervise([], _host(save, "--plan", "alarm", "--family", "nonfinite"))
    assert out.returncode == 42 and "stops on it" in records(save)[-1]["reason"]
    assert len(_launches(save)) == 1 and set(tree(save)) >= {"iter_0000005/metadata.json", "iter_0000010/metadata.json"}


def test_sigterm_reaches_the_command_and_stops(tmp_path: Path):
    save = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "mechmon_megatron.supervise", "--", *_host(save, "--plan", "sleep")],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (save / "launches.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # past the --help check, into the launch
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert time.monotonic() - start < 10, output
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "signal SIGTERM" in records(save)[-1]["reason"]


def test_a_remedy_already_in_effect_is_passed_over(tmp_path: Path):
    """A remedy that would change no flag relaunches the run that alarmed: the next one is used."""
    save = tmp_path / "ck"
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"version": 1, "families": {"router_entropy": "router"}, "remedies": {"router": [
        {"name": "balancing", "alternatives": [{"at_least": {"--moe-aux-loss-coeff": 0.01}}]},
        {"name": "lower-lr", "alternatives": [{"scale": {"--lr": 0.5}}]}]}}))
    out = supervise(["--policy", policy], _host(save, "--plan", "alarm,ok", "--family", "router_entropy",
                                                "--moe-aux-loss-coeff", "0.01", "--lr", "0.004"))
    assert out.returncode == 0, out.output
    relaunch = records(save)[0]
    assert relaunch["remedy"] == "lower-lr" and relaunch["flags_added"][0] == "--lr 0.002"
    assert "remedy balancing changes nothing here" in relaunch["notes"][0]


def test_again_with_no_older_checkpoint_goes_back_to_the_commands_start(tmp_path: Path):
    save, policy = tmp_path / "ck", tmp_path / "policy.json"
    remedies = [{"name": f"r{k}", "alternatives": [{"scale": {"--lr": 0.5}}]} for k in range(3)]
    policy.write_text(json.dumps({"version": 1, "families": {"attn_delta2": "a"}, "remedies": {"a": remedies}}))
    out = supervise(["--policy", policy], _host(save, "--plan", "alarm,alarm,alarm,ok", "--lr", "0.008"))
    assert out.returncode == 0, out.output
    recs = records(save)
    assert [r["checkpoint"]["name"] for r in recs[:3]] == ["iter_0000010", "iter_0000005", "start"]
    assert "no checkpoint is older: from the command's own start" in recs[2]["why"]
    last = _launches(save)[3]
    assert "--load" not in last and "--ckpt-step" not in last and last[last.index("--lr") + 1] == "0.001"


def test_load_is_save_and_the_first_launch_started_fresh(tmp_path: Path):
    """``--load X --save X`` (Megatron's usual script) on an empty X: a rollback to the command's
    own start must not keep ``--load X``, which would resume the abort's checkpoint."""
    save = tmp_path / "ck"
    out = supervise(["--select-flag="], [*_host(save, "--plan", "alarm,ok", "--family", "router_entropy",
                                              "--load", str(save)), "--first-warning", "0"])
    assert out.returncode == 0, out.output
    relaunch = records(save)[0]
    assert relaunch["checkpoint"]["name"] == "start" and "--load dropped" in relaunch["notes"][-1]
    assert "--load" not in _launches(save)[1]


def test_load_is_save_and_the_first_launch_resumed_a_save(tmp_path: Path):
    """The same with a checkpoint in X before the first launch: the start is that checkpoint, chosen
    by the selection flag (the tracker now names a later save); without one the supervisor stops."""
    save = tmp_path / "ck"
    _megatron_save(save, 3)
    host = [*_host(save, "--plan", "alarm,ok", "--family", "router_entropy", "--load", str(save)),
            "--first-warning", "4"]
    out = supervise([], host)
    assert out.returncode == 0, out.output
    relaunch = records(save)[0]
    assert relaunch["checkpoint"]["name"] == "iter_0000003", relaunch  # a listed save at or before 4
    assert _launches(save)[1][-2:] == ["--ckpt-step", "3"]
    save = tmp_path / "no_flag"
    _megatron_save(save, 3)
    out = supervise(["--select-flag="], [*_host(save, "--plan", "alarm,ok", "--family", "router_entropy",
                                              "--load", str(save)), "--first-warning", "4"])
    assert out.returncode != 0 and "never rewrites the tracker" in records(save)[-1]["reason"], out.output
