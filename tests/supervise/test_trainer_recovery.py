"""The loop around the real example trainer: a drill aborts it (checkpoint-and-abort, exit 42),
the supervisor rolls back to the newest checkpoint at or before the change point, applies the
policy's remedy and relaunches with --load/--ckpt-step; the relaunch finishes (exit 0).

The drill fires at its iteration on every launch that reaches it, so a policy that keeps
``--mechmon-drill-at`` makes the same family alarm again: that drives the escalation, the end
of the list and --max-restarts on the real host (slow tests, MECHMON_SLOW=1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.megatron_core._torchrun import free_port
from tests.supervise._helpers import Hook, records, supervise

pytest.importorskip("megatron.core")

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--ffn-hidden-size", "64", "--micro-batch-size", "2", "--corpus-max-bytes", "200000", "--seed", "3"]
MECHMON = ["--mechmon", "--mechmon-interval", "5", "--mechmon-delta", "5", "--mechmon-action", "checkpoint-and-abort",
           "--mechmon-drill-at", "12"]
TRAINER = [sys.executable, "-m", "gpt_trainer"]


def _trainer(save: Path, *extra: str) -> list[str]:
    return [*TRAINER, *TINY, *MECHMON, "--train-iters", "16", "--save", str(save), "--save-interval", "5", *extra]


def _policy(tmp_path: Path, remedies: list[dict]) -> Path:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"version": 1, "families": {"drill": "drill"}, "remedies": {"drill": remedies}}))
    return path


def test_drill_is_recovered_from_the_change_point(tmp_path: Path):
    save = tmp_path / "ck"
    with Hook() as hook:
        out = supervise(["--webhook", hook.url], _trainer(save, "--mechmon-alert-webhook", hook.url), timeout_s=400)
    assert out.returncode == 0, out.output[-4000:]
    relaunch, done = records(save)
    assert relaunch["action"] == "relaunch" and relaunch["exit_code"] == 42
    assert relaunch["alert"]["family"] == "drill" and relaunch["alert"]["first_warning_step"] == 12
    # 12 is the abort checkpoint (the alarmed state): the rollback is the newest before it
    assert relaunch["checkpoint"]["name"] == "iter_0000010" and not relaunch["after_change_point"]
    assert relaunch["remedy"] == "resume-without-drill" and relaunch["flags_removed"] == ["--mechmon-drill-at 12"]
    assert relaunch["flags_added"] == [f"--load {save}", "--ckpt-step 10"]
    assert done["action"] == "stop" and done["exit_code"] == 0
    assert f"loaded checkpoint from {save} at iteration 10" in out.output
    assert "no --save-interval" not in out.output and "does not set --mechmon" not in out.output
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "16"
    for name in ("iter_0000005", "iter_0000010", "iter_0000015", "iter_0000016"):  # nothing deleted
        assert (save / name / "metadata.json").is_file(), name
    kept = save / "mechmon_aborted" / "launch-1" / "iter_0000012"  # the abort checkpoint, moved aside
    assert (kept / "metadata.json").is_file() and (kept / "mechmon_alert.json").is_file()
    assert "saved checkpoint at iteration 5 to" in out.output and "training done at iteration 16" in out.output
    assert "[mechmon] done: 2 checks this launch, alarms: drill at 12; records in" in out.output  # checks 5, 10
    assert "[mechmon] done: 1 check this launch, alarms: none" in out.output  # the relaunch: check 15
    events = [(b["mechmon"]["event"], b["mechmon"].get("family") or b["mechmon"].get("action")) for b in hook.bodies]
    assert events == [("alarm", "drill"), ("recovery", "relaunch"), ("recovery", "stop")], events


def _lr_by_launch(metrics: Path) -> list[dict[int, float]]:
    """The LR each iteration trained with, per launch (a launch starts where the iterations restart)."""
    launches: list[dict[int, float]] = []
    last = None
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if last is None or row["iteration"] <= last:
            launches.append({})
        launches[-1][row["iteration"]] = row["lr"]
        last = row["iteration"]
    return launches


def test_foreign_checkpoint_left_alone_abort_kept_and_lr_remedy_in_effect(tmp_path: Path):
    """Another run left iter_5, 10 and 14 in --save; the supervised run rewrites 5 and 10 and its
    drill aborts at 15. The rollback is this run's iter_0000010 (not the other run's 14, the newer
    one), the abort checkpoint is moved aside with its alert before the relaunch saves iter_15
    again, and the halved LR is the LR the relaunch trains with (the checkpoint's schedule would
    otherwise win: iterations 11-15 would repeat the first launch's rates)."""
    save, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    other = subprocess.run([*TRAINER, *TINY, "--train-iters", "14", "--save", str(save), "--save-interval", "5"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert other.returncode == 0, other.stdout[-2000:] + other.stderr[-2000:]
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000005", "iter_0000010", "iter_0000014"]
    policy = _policy(tmp_path, [{"name": "half-lr", "alternatives": [
        {"remove": ["--mechmon-drill-at"], "scale": {"--lr": 0.5, "--min-lr": 0.5}}]}])
    command = [*TRAINER, *TINY, *MECHMON[:-1], "15", "--train-iters", "18", "--save", str(save), "--save-interval",
               "5", "--lr", "0.001", "--min-lr", "0.0001", "--metrics-jsonl", str(metrics)]
    out = supervise(["--policy", policy], command, timeout_s=400)
    assert out.returncode == 0, out.output[-4000:]
    relaunch = records(save)[0]
    assert relaunch["checkpoint"]["name"] == "iter_0000010", relaunch
    assert any("iter_0000014" in note and "not this run's" in note for note in relaunch["notes"]), relaunch["notes"]
    assert (save / "iter_0000014" / "metadata.json").is_file()  # left alone
    kept = save / "mechmon_aborted" / "launch-1" / "iter_0000015"
    assert relaunch["aborted"]["to"] == str(kept)
    assert json.loads((kept / "mechmon_alert.json").read_text())["iteration"] == 15
    assert (kept / "metadata.json").is_file()
    assert (save / "iter_0000015" / "metadata.json").is_file()  # the relaunch's own save, beside the kept one
    assert not (save / "iter_0000015" / "mechmon_alert.json").exists()
    assert "--override-opt_param-scheduler" in relaunch["flags_added"]
    assert "--override-opt_param-scheduler: LR schedule from the flags" in out.output
    first, second = _lr_by_launch(metrics)
    assert sorted(first) == list(range(1, 16)) and sorted(second) == list(range(11, 19))
    for iteration in range(11, 16):
        assert second[iteration] == pytest.approx(0.5 * first[iteration], rel=1e-9), (iteration, first, second)


@pytest.mark.slow
def test_same_family_again_escalates_then_stops_on_the_real_trainer(tmp_path: Path):
    remedies = [{"name": "fp32-o", "alternatives": [{"set": {"--fa-fp32-o": True}}]},
                {"name": "tie-shift", "alternatives": [{"set": {"--fa-tie-shift-beta": 4}}]}]
    save = tmp_path / "ck"
    out = supervise(["--policy", _policy(tmp_path, remedies), "--max-restarts", "5"], _trainer(save), timeout_s=600)
    assert out.returncode == 42, out.output[-4000:]
    recs = records(save)
    assert [r["action"] for r in recs] == ["relaunch", "relaunch", "stop"]
    assert [r["remedy"] for r in recs[:2]] == ["fp32-o", "tie-shift"]
    assert "every drill remedy tried" in recs[-1]["reason"]
    # the first remedy stays; the rollback goes one save further back (iter_0000010 alarmed again)
    assert sorted(recs[1]["flags_added"]) == ["--ckpt-step 5", "--fa-tie-shift-beta 4"]
    save = tmp_path / "m1"
    out = supervise(["--policy", _policy(tmp_path, remedies), "--max-restarts", "1"], _trainer(save), timeout_s=600)
    assert out.returncode == 42 and [r["action"] for r in records(save)] == ["relaunch", "stop"], out.output[-3000:]
    assert "1 restarts done" in records(save)[-1]["reason"]


@pytest.mark.slow
def test_a_remedy_the_trainer_refuses_at_start_up_stops(tmp_path: Path):
    save = tmp_path / "ck"
    policy = _policy(tmp_path, [{"name": "bad", "alternatives": [{"set": {"--lr": "abc"}}]}])
    out = supervise(["--policy", policy], _trainer(save), timeout_s=600)
    assert out.returncode == 2, out.output[-3000:]
    assert [r["action"] for r in records(save)] == ["relaunch", "stop"] and "invalid float value" in out.output


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_tp2_under_torchrun_are_recovered(tmp_path: Path):
    save = tmp_path / "ck"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "-m", "gpt_trainer"]
    command = [*launcher, *TINY, *MECHMON, "--tensor-model-parallel-size", "2", "--train-iters", "16",
               "--save", str(save), "--save-interval", "5"]
    out = supervise([], command, timeout_s=600)
    assert out.returncode == 0, out.output[-4000:]
    relaunch, done = records(save)
    # torchrun exits 1 for the failed workers; the fresh alert tells the abort from a crash
    assert relaunch["exit_code"] == 1 and relaunch["checkpoint"]["name"] == "iter_0000010"
    assert relaunch["command"][:len(launcher)] == launcher  # torchrun's own options untouched
    assert sorted(p.name for p in (save / "iter_0000016" / "mechmon_extra").iterdir()) == ["rank_00000.pt",
                                                                                          "rank_00001.pt"]
    assert done["exit_code"] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_drill_under_nvidia_resiliency_ext_ft_launcher_is_recovered(tmp_path: Path):
    """ft_launcher (nvidia-resiliency-ext) as the launcher, its own restarts off: it passes the
    worker's abort through as a failed run, and the supervisor rolls back and relaunches it."""
    if os.environ.get("MECHMON_REQUIRE_NVRX") == "1":  # make test-slow installs it: a skip would hide a break
        import nvidia_resiliency_ext.fault_tolerance.launcher  # noqa: F401
    else:
        pytest.importorskip("nvidia_resiliency_ext.fault_tolerance.launcher")
    save = tmp_path / "ck"
    launcher = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--nproc-per-node", "1",
                "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                "-m", "gpt_trainer"]
    out = supervise([], [*launcher, *TINY, *MECHMON, "--train-iters", "16", "--save", str(save),
                         "--save-interval", "5"], timeout_s=600)
    assert out.returncode == 0, out.output[-4000:]
    relaunch, done = records(save)
    assert relaunch["exit_code"] != 0 and relaunch["checkpoint"]["name"] == "iter_0000010"
    assert relaunch["command"][:len(launcher)] == launcher and done["exit_code"] == 0
