"""Scenario flags, the run plan, and the parallel runner (with a stand-in trainer script)."""

import os
import textwrap

import pytest

from mechmon_megatron.research.study import scenarios as S
from mechmon_megatron.research.study.runner import launch_runs


def _flag(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


def test_each_scenario_sets_its_fault_only():
    preset = S.get_preset("demo")
    clean = S.trainer_flags(S.get_scenario("clean"), preset, 1, 100)
    fa = S.trainer_flags(S.get_scenario("fa"), preset, 1, 100)
    moe_lr = S.trainer_flags(S.get_scenario("moe-lr"), preset, 1, 100)
    moe_gbs = S.trainer_flags(S.get_scenario("moe-gbs"), preset, 1, 100)
    combined = S.trainer_flags(S.get_scenario("combined"), preset, 1, 100)
    assert "--fa-fault-strength" not in clean and "--fa-fault-strength" not in moe_lr
    assert float(_flag(fa, "--fa-fault-strength")) == preset.fa_strength
    assert int(_flag(fa, "--fa-fault-onset")) == preset.fa_onset
    assert _flag(fa, "--fa-fault-mode") == "all_rows"
    assert _flag(clean, "--lr") == _flag(fa, "--lr") == _flag(moe_gbs, "--lr")
    assert _flag(moe_lr, "--lr") == _flag(combined, "--lr") != _flag(clean, "--lr")
    assert int(_flag(moe_gbs, "--global-batch-size")) < int(_flag(clean, "--global-batch-size"))
    router_lr = S.trainer_flags(S.get_scenario("moe-router-lr"), preset, 1, 100)
    assert float(_flag(router_lr, "--router-lr-mult")) == preset.router_lr_mult > 1
    assert all("--router-lr-mult" not in f for f in (clean, fa, moe_lr, moe_gbs, combined))
    assert _flag(router_lr, "--lr") == _flag(clean, "--lr") and "--fa-fault-strength" not in router_lr
    assert (
        S.get_scenario("moe-router-lr").fault_onset(preset)
        == S.get_scenario("moe-router-lr").router_fault_onset(preset)
        == 1
    )
    for flags in (clean, fa, moe_lr, moe_gbs, combined, router_lr):
        assert _flag(flags, "--mechmon-action") == "log"
        assert "--mechmon-per-head-scalars" in flags and "--log-max-attention-logit" in flags
        assert _flag(flags, "--train-iters") == "100" and _flag(flags, "--seed") == "1"


def test_plan_runs_and_calibration_seed():
    preset = S.get_preset("full")
    runs = S.plan_runs(("clean", "fa"), (1, 2), preset, train_iters=50, calibration_seed=0)
    assert [r.run_id for r in runs] == ["calib-clean-seed0", "clean-seed1", "clean-seed2", "fa-seed1", "fa-seed2"]
    assert runs[0].calibration and not any(r.calibration for r in runs[1:])
    assert runs[3].fault_onset == preset.fa_onset and runs[1].fault_onset is None
    assert runs[3].router_fault_onset is None
    combined = S.plan_runs(("combined", "moe-gbs"), (1,), preset)
    assert [(r.fault_onset, r.router_fault_onset) for r in combined] == [(preset.fa_onset, 1), (1, 1)]
    with pytest.raises(ValueError, match="calibration seed 1 is also a reported seed"):
        S.plan_runs(("clean",), (1, 2), preset, calibration_seed=1)
    with pytest.raises(ValueError, match="unknown scenario 'nope'"):
        S.plan_runs(("nope",), (1,), preset)
    with pytest.raises(ValueError, match="--train-iters must be >= 1"):
        S.plan_runs(("clean",), (1,), preset, train_iters=0)


FAKE_TRAINER = textwrap.dedent(
    """
    import json, sys
    args = sys.argv[1:]
    get = lambda name: args[args.index(name) + 1]
    iters = int(get("--train-iters"))
    if get("--seed") == "13":
        print("boom"); sys.exit(3)
    with open(get("--metrics-jsonl"), "w") as f:
        for t in range(1, iters + 1):
            row = {"iteration": t, "lm_loss": 2.0, "grad_norm": 1.0, "lr": 0.1, "step_time_s": 0.0}
            f.write(json.dumps(row) + "\\n")
    """
)


def test_launch_runs_in_parallel_with_a_stand_in_trainer(tmp_path):
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    preset = S.get_preset("demo")
    specs = S.plan_runs(("clean", "fa"), (1, 13), preset, train_iters=5)
    results = launch_runs(specs, str(tmp_path / "out"), jobs=2, trainer=str(trainer), progress=False, poll_s=0.05)
    assert [r.spec.run_id for r in results] == [s.run_id for s in specs]
    for r in results:
        if r.spec.seed == 13:
            assert r.returncode == 3 and "boom" in r.tail
        else:
            assert r.returncode == 0
            with open(os.path.join(r.run_dir, "metrics.jsonl")) as f:
                assert len(f.readlines()) == 5
            with open(os.path.join(r.run_dir, "command.txt")) as f:
                cmd = f.read()
            assert "--mechmon-log-dir" in cmd and "--tensorboard-dir" in cmd and "--num-threads 1" in cmd
    with pytest.raises(ValueError, match="--jobs must be >= 1"):
        launch_runs(specs, str(tmp_path / "out"), jobs=0, trainer=str(trainer), progress=False)


SLOW_TRAINER = textwrap.dedent(
    """
    import os, sys, time
    args = sys.argv[1:]
    out = os.path.dirname(args[args.index("--metrics-jsonl") + 1])
    with open(os.path.join(out, "pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    """
)

DRIVER = textwrap.dedent(
    """
    import sys
    from mechmon_megatron.research.study import scenarios as S
    from mechmon_megatron.research.study.runner import launch_runs
    specs = S.plan_runs(("clean",), (1,), S.get_preset("demo"), train_iters=5)
    launch_runs(specs, sys.argv[1], jobs=1, trainer=sys.argv[2], progress=False, poll_s=0.05)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone for our purpose
    except FileNotFoundError:
        return False


def test_sigterm_stops_the_runs_it_launched(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    trainer, driver = tmp_path / "slow.py", tmp_path / "driver.py"
    trainer.write_text(SLOW_TRAINER)
    driver.write_text(DRIVER)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(driver), str(out), str(trainer)])
    pid_file = out / "runs" / "clean-seed1" / "pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_study_runs_pin_the_cpu_settings(tmp_path, monkeypatch):
    """The runner starts every run under the pinned CPU settings (research/reproducible_cpu.py):
    they win over the caller's environment (ATen, MKL and oneDNN round differently per CPU), the
    caller's environment is untouched, and a run's explicit override wins over the pin."""
    import json
    import os
    import sys

    from mechmon_megatron.research.reproducible_cpu import PINNED_CPU_SETTINGS
    from mechmon_megatron.research.study.runner import launch_runs, run_environment
    from mechmon_megatron.research.study.scenarios import RunSpec

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    spec = RunSpec(scenario="clean", seed=1, train_iters=1, fault_onset=None)
    keys = sorted(PINNED_CPU_SETTINGS)
    script = f"import os, json; open('env.json', 'w').write(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    launch_runs(
        [spec],
        str(tmp_path),
        progress=False,
        poll_s=0.1,
        command_for=lambda s, d: [sys.executable, "-c", script.replace("env.json", f"{d}/env.json")],
    )
    seen = json.load(open(tmp_path / "runs" / spec.run_id / "env.json"))
    assert seen == PINNED_CPU_SETTINGS
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default" and "ONEDNN_MAX_CPU_ISA" not in os.environ
    assert run_environment({"MKL_CBWR": "AUTO"})["MKL_CBWR"] == "AUTO"
