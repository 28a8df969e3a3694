"""The resumable campaign launcher on real (tiny) trainer runs: resume and fork are bit-identical."""

import json
import os

import pytest

from mechmon_megatron.research.study.analysis import read_jsonl
from mechmon_megatron.research.study.campaign import _diverged_long_enough, latest_checkpoint, launch_campaign
from mechmon_megatron.research.study.campaign_data import joined_rows
from mechmon_megatron.research.study.long_plan import CampaignRun, plan_campaign

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --num-experts 4 --moe-router-topk 2 "
    "--attention-backend emulated-lowp-fa --micro-batch-size 2 --lr 2e-3 --lr-decay-iters 100 --seed 1 "
    "--mechmon --mechmon-interval 5 --mechmon-delta 10 --mechmon-action log --mechmon-per-head-scalars"
).split()


def _run(run_id, iters, **kw):
    return CampaignRun(
        run_id=run_id,
        kind=kw.pop("kind", "healthy"),
        scenario="clean",
        seed=1,
        train_iters=iters,
        flags=tuple(BASE + ["--train-iters", str(iters)] + list(kw.pop("extra", ()))),
        **kw,
    )


def _losses(path):
    return {r["iteration"]: r["lm_loss"] for r in read_jsonl(path)}


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
@pytest.mark.distributed
def test_interrupted_resumed_and_forked_runs_match_the_uninterrupted_one(tmp_path):
    out = str(tmp_path)
    whole = _run("whole", 30, save_interval=100)
    interrupted = _run("interrupted", 30, interrupt_at=15, save_interval=5, save_at=(10,))
    fork = _run(
        "fork",
        30,
        kind="fault",
        parent="interrupted",
        fork_at=10,
        fault_onset=20,
        save_interval=100,
        extra=("--fa-fault-strength", "32", "--fa-fault-onset", "20", "--fa-fault-mode", "all_rows"),
    )
    status = launch_campaign([whole, interrupted, fork], out, jobs=2, progress=False, poll_s=0.5)
    assert {k: v["state"] for k, v in status.items()} == {"whole": "done", "interrupted": "done", "fork": "done"}
    assert [x["how"] for x in status["interrupted"]["launches"]] == ["fresh", "resumed at 15"]
    assert status["fork"]["launches"][0]["how"] == "forked from interrupted at 10"
    runs = os.path.join(out, "runs")
    a = _losses(os.path.join(runs, "whole", "metrics.jsonl"))
    b = _losses(os.path.join(runs, "interrupted", "metrics.jsonl"))
    f = _losses(os.path.join(runs, "fork", "metrics.jsonl"))
    assert sorted(b) == list(range(1, 31)) and a == b  # every step once, bit-identical after the resume
    assert min(f) == 11 and all(f[i] == a[i] for i in range(11, 21))  # identical until the fault acts
    assert any(f[i] != a[i] for i in range(21, 31))

    def scalars(run_id):
        rows = read_jsonl(os.path.join(runs, run_id, "mechmon", "mechmon_scalars.jsonl"))
        return {row["step"]: row["scalars"] for row in rows}

    sa, sb = scalars("whole"), scalars("interrupted")
    assert set(sa) == set(sb)
    # the first check after the resume has no t - delta snapshot: routers only at step 20
    assert any(k.startswith("mechmon/attn/") for k in sa[20])
    assert not any(k.startswith("mechmon/attn/") for k in sb[20])

    def values(row):  # wall time differs between runs
        return {k: v for k, v in row.items() if k != "mechmon/overhead_ms"}

    assert all(values(sa[s]) == values(sb[s]) for s in sb if s != 20)
    metrics, checks = joined_rows(out, fork)
    assert [r["iteration"] for r in metrics] == list(range(1, 31))
    assert latest_checkpoint(os.path.join(runs, "interrupted")) == 30
    # relaunching a finished campaign does nothing
    again = launch_campaign([whole, interrupted, fork], out, jobs=2, progress=False, poll_s=0.5)
    assert len(again["interrupted"]["launches"]) == 2


def test_divergence_stop_rule(tmp_path):
    run = _run("r", 400, stop_after_divergence=50)
    d = tmp_path / "runs" / "r"
    d.mkdir(parents=True)
    rows = [{"iteration": i, "lm_loss": 2.0 if i < 200 else 4.0} for i in range(1, 240)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _diverged_long_enough(str(tmp_path), run) is None  # diverged at ~200, only 39 steps ago
    rows += [{"iteration": i, "lm_loss": 4.0} for i in range(240, 270)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _diverged_long_enough(str(tmp_path), run) is not None


def test_plan_forks_at_onset_minus_delta_and_has_the_required_runs():
    runs = {r.run_id: r for r in plan_campaign()}
    healthy = [r for r in runs.values() if r.kind == "healthy"]
    assert len(healthy) >= 4 and all(r.train_iters == 10_000 for r in healthy)
    assert any(r.schedule == "wsd" for r in healthy) and any(r.interrupt_at for r in healthy)
    for r in runs.values():
        if r.parent:
            assert r.fork_at == r.fault_onset - 100 and r.fork_at in runs[r.parent].save_at
    for strength in (32, 16):
        for onset in (500, 2000):
            assert sum(1 for r in runs if r.startswith(f"fa-s{strength}-on{onset}-")) >= 3
    assert (
        sum(1 for r in runs if r.startswith("moe-router-lr")) >= 3
        and sum(1 for r in runs if r.startswith("moe-lr")) >= 3
    )


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_a_fork_whose_parent_fails_fails_instead_of_waiting(tmp_path):
    parent = _run("parent", 30, extra=("--hidden-size", "63"))  # 63 is not divisible by 4 heads: fails at start
    fork = _run("fork", 30, kind="fault", parent="parent", fork_at=10, fault_onset=20)
    status = launch_campaign([parent, fork], str(tmp_path), jobs=2, progress=False, poll_s=0.5)
    assert status["parent"]["state"] == "failed" and status["fork"]["state"] == "failed"
    assert "no checkpoint at 10" in status["fork"]["tail"]
