"""The planner's command line: JSON keys, labels, bad input (exit 2 naming the flag), measured path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mechmon_megatron.plan.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--kv-channels", "16", "--num-experts", "4", "--moe-router-topk", "2", "--seq-length", "32",
            "--global-batch-size", "4"]


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_has_the_stable_keys(capsys):
    code, out, _ = _run(["--model", "llama3-70b", "--tp", "8", "--pp", "4", "--dp", "32", "--no-measure", "--json"],
                        capsys)
    assert code == 0
    report = json.loads(out)
    for key in ("snapshot_bytes_per_rank", "check_flops_per_rank", "check_time_s_per_rank", "overhead_share"):
        assert key in report
    # One Q+K slice of one layer (8 heads + 1 group) plus one gathered layer (64 + 8 heads), FP32.
    assert report["snapshot_bytes_per_rank"] == ((8 + 1) + (64 + 8)) * 128 * 8192 * 4
    ct = report["check_time_s_per_rank"]
    assert ct["label"] == "estimated"
    for comp in ct["components"].values():
        assert comp["label"] == "estimated" and comp["measured"] is None and comp["scaled"]
    assert report["step_time_source"].startswith("estimated")
    assert 0 < report["overhead_share"] < report["target_share"]
    assert report["settings"]["interval"] == 100 and report["settings"]["overlap"] == 1


def test_given_step_time_and_model_weights(capsys):
    code, out, _ = _run(["--model", "llama3-8b", "--dp", "8", "--no-measure", "--json", "--weights", "model",
                         "--step-time-s", "2.0", "--interval", "50", "--delta", "120"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["step_time_s"] == 2.0 and report["step_time_source"].startswith("given")
    # 32 layers over 8 DP ranks: 4 shared (TP 1) units of (32 + 8) heads, BF16, ceil(120 / 50) = 3 sets.
    assert report["snapshot_bytes_per_rank"] == 3 * 4 * 40 * 128 * 4096 * 2
    expected = report["check_time_s_per_rank"]["total"] / 50 / 2.0
    assert report["overhead_share"] == pytest.approx(expected)


def test_measured_path_at_a_tiny_shape(capsys):
    code, out, _ = _run([*TINY_MOE, "--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--device", "cpu",
                         "--repeats", "1", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    comps = report["check_time_s_per_rank"]["components"]
    for name in ("attn_heads", "attn_full", "router_stats", "router_weights", "snapshot_copy"):
        if comps[name]["units"]:
            assert comps[name]["label"] == "measured", name
            assert comps[name]["measured"].endswith("median of 1") and "on cpu" in comps[name]["measured"]
    assert comps["tp_gather"]["label"] == "estimated"
    assert report["check_time_s_per_rank"]["total"] > 0
    assert report["reference_gpu_estimate"]["label"] == "estimated"


def test_table_output(capsys):
    code, out, _ = _run(["--model", "deepseek-v3", "--dp", "1024", "--ep", "64", "--no-measure"], capsys)
    assert code == 0
    assert "router_stats" in out and "overhead share" in out
    assert "rollback: the change point lies up to" in out


def test_plan_reports_the_change_point_lag_it_assumes(capsys):
    from mechmon_megatron.session.rollback_reach import change_point_lag

    code, out, _ = _run(["--model", "llama3-8b", "--no-measure", "--json", "--interval", "20", "--delta", "100"],
                        capsys)
    rollback = json.loads(out)["rollback"]
    assert code == 0 and rollback["change_point_lag_steps"] == change_point_lag(20, 100)
    assert rollback["keep_checkpoints_at_save_interval"]["100"] == -(-change_point_lag(20, 100) // 100) + 2


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--model", "gpt5"], "--model"),
        (["--model", "llama3-70b", "--tp", "3"], "--tp"),
        (["--model", "llama3-70b", "--pp", "7"], "--pp"),
        (["--model", "deepseek-v3", "--dp", "1024", "--ep", "3"], "--ep"),
        (["--model", "llama3-8b", "--interval", "0"], "--interval"),
        (["--model", "llama3-8b", "--step-time-s", "-1"], "--step-time-s"),
        (["--num-layers", "2"], "--model"),
        (["--model", "llama3-8b", "--full-matrix-rank", "0"], "--full-matrix-rank"),
        (["--model", "llama3-8b", "--mfu", "1.5"], "--mfu"),
        (["--model", "llama3-8b", "--threads", "0"], "--threads"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(argv, flag, capsys):
    code, out, err = _run([*argv, "--no-measure"], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"mechmon-plan: error: {flag} ")


def test_the_tool_wrapper_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "mechmon_plan.py"), "--model", "llama3-405b",
                           "--tp", "8", "--pp", "14", "--dp", "128", "--no-measure", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["layout"]["world_size"] == 14336
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "mechmon_plan.py"), "--model", "nope"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "--model" in bad.stderr


def test_setup_declares_the_console_script():
    assert "mechmon-plan=mechmon_megatron.plan.cli:main" in (ROOT / "setup.py").read_text(encoding="utf-8")


def test_a_unit_too_large_for_memory_is_measured_reduced_and_scaled(monkeypatch, capsys):
    from mechmon_megatron.plan import measure

    limit = measure.heads_memory(2, 1, 16, 64, 4) + 1  # half the heads of the tiny layer fit
    monkeypatch.setattr(measure, "fits", lambda nbytes, device: nbytes <= limit)
    code, out, _ = _run([*TINY_MOE, "--tp", "1", "--device", "cpu", "--repeats", "1", "--json"], capsys)
    assert code == 0
    comps = json.loads(out)["check_time_s_per_rank"]["components"]
    assert "check_heads(2 heads, 1 K groups" in comps["attn_heads"]["measured"]
    assert "W_q [32, 64]" in comps["attn_full"]["measured"]
    for name in ("attn_heads", "attn_full"):
        assert comps[name]["label"] == "measured" and "[reduced to fit memory; scaled x" in comps[name]["measured"]


def test_distributed_optimizer_adds_the_main_parameter_gathers(capsys):
    base = ["--model", "llama3-70b", "--tp", "8", "--pp", "4", "--dp", "32", "--no-measure", "--json"]
    _, out, _ = _run([*base, "--distributed-optimizer"], capsys)
    report = json.loads(out)
    comps = report["check_time_s_per_rank"]["components"]
    assert "main_param_allreduce" not in comps  # the shard is gathered, never all-reduced whole
    comp = comps["main_param_gather"]
    # 20 layers per stage, each gathered to its per-head replica and its full-matrix replica
    # (L - 1) % 32 and ((L - 1) % 256) // 8 differ for every layer of the stage but the first of
    # stage 0 (both 0): 2 reads x (20 x 2 - 1) on stage 0, the most loaded rank's stage here.
    stage = report["check_time_s_per_rank"]["rank"]["pp"]
    users = sum(len({(L - 1) % 32, ((L - 1) % 256) // 8}) for L in range(20 * stage + 1, 20 * stage + 21))
    assert comp["units"] == 2 * users and comp["time_s"] > 0 and comp["label"] == "estimated"
    # Q and K rows only (64 + 8 heads of 128 of hidden 8192, / TP 8, FP32), 31/32 of them received.
    assert f"{4 * 72 * 128 * 8192 / 8 * 31 / 32 / 2**20:.1f} MiB" in comp["scaled"]
    _, out, _ = _run([*base, "--distributed-optimizer", "--weights", "model"], capsys)
    assert json.loads(out)["check_time_s_per_rank"]["components"]["main_param_gather"]["units"] == 0
    _, out, _ = _run(base, capsys)
    assert json.loads(out)["check_time_s_per_rank"]["components"]["main_param_gather"]["units"] == 0
