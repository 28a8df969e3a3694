"""The CPU-side parts of tools/gpu_check.sh: shell syntax, the part runner, the A/B and bench wrappers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "tools" / "gpu_check"


def _load_runner():
    spec = importlib.util.spec_from_file_location("gpu_check_run_all", GPU_CHECK / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _env() -> dict:
    path = os.pathsep.join([str(ROOT), str(ROOT / "examples" / "pretrain_scripts"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def test_shell_scripts_parse():
    for script in (ROOT / "tools" / "gpu_check.sh", GPU_CHECK / "fetch_wheels.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_usage_error_without_out_dir():
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_runner_records_ok_failed_timeout_and_absent(tmp_path):
    runner = _load_runner()
    log = open(tmp_path / "log", "w", encoding="utf-8")
    py = sys.executable
    ok = runner.run_part(runner.Part("ok", [py, "-c", "print('noise'); print('{\"a\": 1}')"], 30), 30, log)
    assert ok["status"] == "ok" and ok["result"] == {"a": 1}
    failed = runner.run_part(runner.Part("bad", [py, "-c", "import sys; sys.exit('boom')"], 30), 30, log)
    assert failed["status"] == "failed" and failed["returncode"] == 1 and "boom" in failed["stderr_tail"]
    slow = runner.run_part(runner.Part("slow", [py, "-c", "import time; time.sleep(60)"], 60), 1, log)
    assert slow["status"] == "timeout" and slow["seconds"] < 30
    absent = runner.run_part(runner.Part("gone", [py, "-c", "0"], 30, requires="tests/no_such_test.py"), 30, log)
    assert absent["status"] == "absent"
    log.close()
    assert "===== bad: failed" in (tmp_path / "log").read_text(encoding="utf-8")


def test_runner_has_every_part_of_the_issue():
    names = [p.name for p in _load_runner().parts("python3", "cuda", "/tmp")]
    assert names[0] == "env"
    assert {"plan_llama3-8b", "plan_llama3-70b", "plan_llama3-405b", "plan_deepseek-v3", "ab_mcore",
            "router_capture_sync", "bench_monitors_4096", "bench_monitors_8192"} <= set(names)


@pytest.mark.slow  # 15 s: the GPU machine's driver script end to end; its parts are tested one by one below
def test_gpu_check_script_on_cpu_writes_one_json(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out), "--device", "cpu", "--only", "env",
         "router_capture_sync", "--budget-s", "120"],
        capture_output=True, text=True, timeout=300, env={**_env(), "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))
    assert report["parts"]["env"]["status"] == "ok"
    assert report["parts"]["env"]["result"]["torch"]
    assert report["parts"]["router_capture_sync"]["status"] in ("ok", "absent", "failed")
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_ab_script_runs_tiny_on_cpu(tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, str(GPU_CHECK / "bench_mcore_ab.py"), "--device", "cpu", "--tiny", "--steps-per-arm", "6",
         "--interval", "3", "--delta", "3", "--repeats", "1", "--warmup", "1", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert len(report["step_s"]["off"]) == len(report["step_s"]["on"]) == 6
    assert report["check_steps"] == 2 and report["config"]["attention"].startswith("scaled_dot_product")
    assert report["session_ms_per_block"][0] > 0  # the session ran its checks


def test_bench_monitors_wrapper_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(GPU_CHECK / "bench_monitors_cuda.py"), "--device", "cpu", "--hidden", "64",
         "--num-heads", "4", "--head-dim", "8", "--num-groups", "2", "--repeats", "1", "--rank", "8", "--json"],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["device"] == "cpu" and report["max_rel_err"] < 1e-4
