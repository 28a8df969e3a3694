"""The pinned CPU settings make a faulty training run the same whatever kernels the caller forced.

The demo's table and the trajectory tests rely on it: a short fa run of the example trainer
(fault from step 5, a check every 5 steps) is trained three times through the study runner:

* caller forces choice A (ATen ``default`` kernels, MKL's AVX2 reproducibility branch, oneDNN
  capped to SSE4.1, MKL instructions SSE4_2, two threads), runs pinned;
* caller forces choice B (AVX-512 everywhere, one thread), runs pinned;
* choice A again with the pin undone for the run (its overrides win): the control, which must
  differ, or the first two runs agreeing would prove nothing (ATen's ``default`` and AVX2
  kernels round differently on every x86 CPU; oneDNN's GELU changes with the ISA cap).

Pinned A and B must agree bit for bit in every metric the trainer logs and every monitor scalar
the detector reads, so their alarms agree too.
"""

import json
import os

from mechmon_megatron.research.reproducible_cpu import PINNED_CPU_SETTINGS
from mechmon_megatron.research.study.runner import launch_runs
from mechmon_megatron.research.study.scenarios import get_preset, plan_runs, with_overrides

_TINY_MODEL = (
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
    "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
    "--lr-warmup-iters", "5", "--attention-backend", "emulated-lowp-fa", "--corpus-max-bytes", "200000",
)
_CHOICE_A = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "SSE41",
             "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
_CHOICE_B = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AUTO", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
             "MKL_ENABLE_INSTRUCTIONS": "AVX512", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_TIMING = ("step_time_s", "wall_time", "mechmon/overhead_ms")


def _train(root, name: str, caller_env: dict[str, str], monkeypatch, overrides=None) -> tuple[list, list]:
    preset = with_overrides(get_preset("demo"), model_flags=_TINY_MODEL, fa_onset=5, mechmon_interval=5,
                            mechmon_delta=5)
    (spec,) = plan_runs(("fa",), (1,), preset, 25, None)
    with monkeypatch.context() as m:
        for key, value in caller_env.items():
            m.setenv(key, value)
        (result,) = launch_runs([spec], str(root / name), progress=False, poll_s=0.2, env_overrides=overrides)
    assert result.returncode == 0, result.tail
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        metrics = [{k: v for k, v in json.loads(line).items() if k not in _TIMING} for line in f]
    with open(os.path.join(result.run_dir, "mechmon", "mechmon_scalars.jsonl")) as f:
        scalars = [{**row, "scalars": {k: v for k, v in row["scalars"].items() if k not in _TIMING}}
                   for row in map(json.loads, f)]
    return metrics, scalars


def test_a_fault_run_is_bit_identical_under_two_forced_kernel_choices(tmp_path, monkeypatch):
    pinned_a = _train(tmp_path, "a", _CHOICE_A, monkeypatch)
    pinned_b = _train(tmp_path, "b", _CHOICE_B, monkeypatch)
    unpinned_a = _train(tmp_path, "a-unpinned", _CHOICE_A, monkeypatch,
                        overrides={k: _CHOICE_A[k] for k in PINNED_CPU_SETTINGS})
    metrics, scalars = pinned_a
    assert len(metrics) == 25 and len(scalars) == 5  # checks at 5, 10, ..., 25
    assert any(key.startswith("mechmon/attn/") for key in scalars[-1]["scalars"])
    assert pinned_a == pinned_b
    assert unpinned_a[0] != metrics, "choice A did not change the rounding: the test cannot tell a pin from none"


def test_the_pin_wins_over_the_caller_and_says_so():
    from mechmon_megatron.research.reproducible_cpu import overridden_settings, pinned_environment

    caller = {"ATEN_CPU_CAPABILITY": "AVX2", "MKL_CBWR": "AVX2", "PATH": "/bin"}
    env = pinned_environment(caller, overrides={"ONEDNN_MAX_CPU_ISA": "SSE41"})
    assert env["PATH"] == "/bin" and env["MKL_CBWR"] == "COMPATIBLE" and env["ONEDNN_MAX_CPU_ISA"] == "SSE41"
    assert caller["MKL_CBWR"] == "AVX2"  # the caller's mapping is not changed
    # the same value in another case is no override; another value is one line naming both
    assert overridden_settings(caller) == ["MKL_CBWR=AVX2 in your environment; the runs use MKL_CBWR=COMPATIBLE"]


def test_check_pin_reads_the_kernels_a_pinned_process_gets():
    import platform

    from mechmon_megatron.research.reproducible_cpu import check_pin

    has_avx2 = platform.machine() == "x86_64" and " avx2" in open("/proc/cpuinfo").read()
    pin = check_pin()
    assert (pin.capability == "AVX2" and pin.reasons == ()) if has_avx2 else pin.reasons
    broken = check_pin(python="/nonexistent/python")
    assert broken.capability == "unknown" and "could not start /nonexistent/python" in broken.reasons[0]
