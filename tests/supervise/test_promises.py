"""The recovery loop keeps its promises, on the stand-in host (a real process, ``_fake_host.py``):
only this run's checkpoints are rollback points, the abort checkpoint is kept aside with its
alert, an LR remedy lets the flags win over a checkpoint's schedule, and a policy or ``--save``
that cannot work is refused before the first launch (exit 2, one line, nothing launched)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from mechmon_megatron.supervise.host import HostFlags
from mechmon_megatron.supervise.policy import load_policy, resolve_policy
from tests.supervise._helpers import FAKE_HOST, records, supervise

SCHEDULE_OVERRIDE = "--override-opt_param-scheduler"


def _host(save: Path, *flags: str) -> list[str]:
    return [sys.executable, str(FAKE_HOST), "--save", str(save), "--first-warning", "10", *flags]


def _launches(save: Path) -> list[list[str]]:
    path = save / "launches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _policy(tmp_path: Path, families: dict, remedies: dict) -> Path:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"version": 1, "families": families, "remedies": remedies}))
    return path


def _megatron_save(save: Path, iteration: int) -> Path:
    folder = save / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text("{}")
    (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return folder


def test_a_foreign_checkpoint_is_never_the_rollback(tmp_path: Path):
    """Another run left iter_0000011 in --save; this run's alarm has its change point at 11: the
    rollback is this run's iter_0000010, and iter_0000011 is named once and left alone."""
    save = tmp_path / "ck"
    foreign = _megatron_save(save, 11)
    out = supervise([], _host(save, "--plan", "alarm,ok", "--first-warning", "11"))
    assert out.returncode == 0, out.output
    relaunch = records(save)[0]
    assert relaunch["checkpoint"]["name"] == "iter_0000010", relaunch
    assert any("left alone, not this run's: iter_0000011" in n for n in relaunch["notes"]), relaunch["notes"]
    assert out.output.count("already holds iter_0000011") == 1, out.output
    assert (foreign / "metadata.json").read_text() == "{}"  # untouched


def test_a_checkpoint_this_run_rewrote_is_its_own(tmp_path: Path):
    """An older run's iter_0000010 rewritten by this run (same name, new files) is this run's."""
    save = tmp_path / "ck"
    _megatron_save(save, 10)
    old = (save / "iter_0000010" / "metadata.json").stat().st_mtime_ns
    os.utime(save / "iter_0000010" / "metadata.json", ns=(old - 10**10, old - 10**10))
    out = supervise([], _host(save, "--plan", "alarm,ok"))
    assert out.returncode == 0, out.output
    assert records(save)[0]["checkpoint"]["name"] == "iter_0000010"


@pytest.mark.parametrize("layout", ["megatron", "deepspeed"])
def test_the_abort_checkpoint_is_kept_aside_with_its_alert(tmp_path: Path, layout: str):
    save = tmp_path / "ck"
    select = [] if layout == "megatron" else ["--select-flag=--ckpt-tag"]
    out = supervise(select, _host(save, "--plan", "alarm,alarm,ok", "--layout", layout))
    assert out.returncode == 0, out.output
    first, second, _ = records(save)
    name = "iter_0000012" if layout == "megatron" else "global_step12"
    for launch, record in ((1, first), (2, second)):
        kept = save / "mechmon_aborted" / f"launch-{launch}" / name
        assert record["aborted"] == {"from": str(save / name), "to": str(kept), "iteration": 12}, record
        alert = json.loads((kept / "mechmon_alert.json").read_text())  # the alert travelled with it
        assert alert["iteration"] == 12 and alert["checkpoint_dir"] == str(save / name)
        assert f"abort checkpoint kept in {kept}" in out.output
    # both aborts of the same iteration kept, neither overwritten by the launch after it
    assert sorted(p.relative_to(save).as_posix() for p in (save / "mechmon_aborted").glob("*/*")) == [
        f"mechmon_aborted/launch-1/{name}", f"mechmon_aborted/launch-2/{name}"]
    # the kept folders are no rollback points: the second alarm rolled back to this run's save again
    assert second["checkpoint"]["name"] in ("iter_0000005", "global_step5"), second


def test_an_lr_remedy_adds_the_schedule_override(tmp_path: Path):
    save = tmp_path / "ck"
    policy = _policy(tmp_path, {"attn_delta2": "lr"},
                     {"lr": [{"name": "half", "alternatives": [{"scale": {"--lr": 0.5, "--min-lr": 0.5}}]}]})
    out = supervise(["--policy", policy], _host(save, "--plan", "alarm,ok", "--lr", "0.004", "--min-lr", "0.0004"))
    assert out.returncode == 0, out.output
    relaunch = records(save)[0]
    assert SCHEDULE_OVERRIDE in relaunch["flags_added"], relaunch
    assert any(f"{SCHEDULE_OVERRIDE} added: --lr, --min-lr win" in n for n in relaunch["notes"]), relaunch["notes"]
    second = _launches(save)[1]
    assert second[second.index("--lr") + 1] == "0.002" and SCHEDULE_OVERRIDE in second


def test_schedule_override_replaces_the_opposite_switch_and_is_added_once():
    from mechmon_megatron.supervise.cli import schedule_notices
    from mechmon_megatron.supervise.remedy import let_flags_set_schedule

    host = HostFlags(flags=frozenset({SCHEDULE_OVERRIDE, "--use-checkpoint-opt_param-scheduler", "--lr"}))
    args, note = let_flags_set_schedule(["--use-checkpoint-opt_param-scheduler", "--lr", "1"], ["--lr 0.5"], host)
    assert args == ["--lr", "1", SCHEDULE_OVERRIDE] and note
    assert let_flags_set_schedule(args, ["--lr 0.25"], host) == (args, None)
    assert let_flags_set_schedule(["--x"], ["--fa-fp32-o"], host) == (["--x"], None)
    bare = HostFlags(flags=frozenset({"--lr"}))
    args, note = let_flags_set_schedule(["--lr", "1"], ["--lr 0.5"], bare)
    assert args == ["--lr", "1"] and "has no --override-opt_param-scheduler" in note
    # and at start-up, for the default policy's LR remedies on such a host
    lines = schedule_notices(resolve_policy(load_policy("default"), HostFlags(flags=frozenset({"--lr", "--min-lr"}))),
                             HostFlags(flags=frozenset({"--lr", "--min-lr"})))
    assert [line.split(" changes")[0] for line in lines] == ["remedy router/lower-lr", "remedy router/lower-lr-again"]


@pytest.mark.parametrize(("body", "message"), [
    ({"families": {"attn_delta3": "a"}}, "families names 'attn_delta3', which no alert carries"),
    ({"scale": math.nan}, "scale.--lr must be a finite number > 0, got nan"),
    ({"scale": -1}, "scale.--lr must be a finite number > 0, got -1"),
    ({"scale": 0}, "scale.--lr must be a finite number > 0, got 0"),
    ({"scale": "half"}, "scale.--lr must be a number, got 'half'"),
    ({"at_least": math.inf}, "at_least.--lr must be a finite number, got inf"),
])
def test_a_policy_that_cannot_work_is_refused_before_the_first_launch(tmp_path: Path, body: dict, message: str):
    edit = ({key: {"--lr": value} for key, value in body.items() if key in ("scale", "at_least")}
            or {"scale": {"--lr": 0.5}})
    path = tmp_path / "policy.json"
    # json.dumps writes NaN / Infinity, which json.load reads back: a user can write them
    path.write_text(json.dumps({"version": 1, "families": body.get("families", {"attn_delta2": "a"}),
                                "remedies": {"a": [{"name": "x", "alternatives": [edit]}]}}))
    save = tmp_path / "ck"
    out = supervise(["--policy", path], _host(save, "--plan", "alarm,ok"))
    assert out.returncode == 2 and message in out.output, out.output
    assert "Traceback" not in out.output and _launches(save) == []


def test_save_that_is_a_file_is_refused_in_one_line(tmp_path: Path):
    save = tmp_path / "ck"
    save.write_text("not a folder")
    out = supervise([], _host(save, "--plan", "ok"))
    assert out.returncode == 2, out.output
    assert f"--save {save} is a file, not a folder" in out.output and "Traceback" not in out.output
    assert save.read_text() == "not a folder"


def test_scan_points_at_the_kept_abort_checkpoints(tmp_path: Path, caplog):
    from mechmon_megatron.scan.errors import ScanInputError
    from mechmon_megatron.scan.series import discover

    kept = tmp_path / "ck" / "mechmon_aborted" / "launch-1" / "iter_0000015"
    kept.mkdir(parents=True)
    with pytest.raises(ScanInputError):
        discover((str(tmp_path / "ck"),), window=1)
    assert "1 abort checkpoint(s) kept by mechmon-supervise" in caplog.text and str(kept) in caplog.text
