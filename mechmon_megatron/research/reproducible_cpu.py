"""The CPU settings under which a training run of the study is bit-identical on any x86-64 machine.

One place for the trainer runs of the fault study, ``make demo`` and the test fixtures that assert
something about a trajectory (an alarm step, a divergence, an anomaly window). Three libraries
choose code paths by the CPU, and each choice changes the rounding, so the loss of the study model
drifts apart within tens of steps (docs/RESULTS.md, "Reproducibility"; capping ATen and MKL's
instruction set alone is not enough: an Intel Xeon and an AMD EPYC still train different runs):

* ATen picks its vector kernels by instruction set (AVX2 or AVX-512): ``ATEN_CPU_CAPABILITY``
  caps it;
* MKL's SGEMM picks a code path by vendor and instruction set; conditional numerical
  reproducibility, ``MKL_CBWR=COMPATIBLE``, runs one code path on every x86 CPU (measured here:
  the same bits under ``MKL_ENABLE_INSTRUCTIONS`` SSE4_2 and AVX2);
* oneDNN JIT-compiles the GELU of the MLP for the best instruction set it finds (``jit:avx2``
  here, ``jit:avx512_core`` on an AVX-512 CPU): ``ONEDNN_MAX_CPU_ISA`` caps it;

and every reduction splits its sums by the thread count: one thread. With these pinned, what is
left is the same torch build, the same Python (the corpus is its standard library) and a CPU with
AVX2 (every x86 CPU since 2013-2015); :func:`check_pin` says when one is missing.

Only the processes the study, the demo and the tests start get these settings; the caller's own
environment is never changed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

PINNED_CPU_SETTINGS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
"""Environment of a reproducible run (the trainer also needs ``--num-threads 1``)."""

IRRELEVANT_UNDER_PIN = ("MKL_ENABLE_INSTRUCTIONS",)
"""Settings a user may have that the pin makes irrelevant (MKL_CBWR=COMPATIBLE fixes MKL's path)."""


def pinned_environment(base: Optional[Mapping[str, str]] = None,
                       overrides: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the pinned settings on top, then
    ``overrides`` (a study's explicit choice, e.g. to measure another kernel setting)."""
    env = dict(os.environ if base is None else base)
    env.update(PINNED_CPU_SETTINGS)
    env.update(overrides or {})
    return env


def overridden_settings(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """One line per pinned variable that ``environ`` sets to another value (the runs use the pin)."""
    env = os.environ if environ is None else environ
    return [f"{key}={env[key]} in your environment; the runs use {key}={value}"
            for key, value in PINNED_CPU_SETTINGS.items()
            if key in env and env[key].strip().lower() != value.lower()]


def effective_capability(python: str = sys.executable, timeout_s: float = 120.0) -> str:
    """The ATen capability a process started under the pin actually runs (``AVX2``, or ``DEFAULT``
    on a CPU without AVX2): torch never uses more than the CPU has."""
    proc = subprocess.run(
        [python, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=pinned_environment(), capture_output=True, text=True, timeout=timeout_s, check=True)
    return proc.stdout.strip().splitlines()[-1]


@dataclass(frozen=True)
class PinCheck:
    """What the pin gives on this machine."""

    capability: str
    """The ATen kernels a process started under the pin runs (``AVX2`` where the pin holds)."""
    reasons: tuple[str, ...]
    """Why runs here may not reproduce the documented numbers (empty where the pin holds)."""


def check_pin(python: str = sys.executable) -> PinCheck:
    """Start one process under the pin and read which kernels it gets."""
    reasons = []
    try:
        capability = effective_capability(python)
    except (OSError, subprocess.SubprocessError) as exc:
        capability = "unknown"
        reasons.append(f"could not start {python} to read its CPU kernels ({exc})")
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        reasons.append(f"this CPU is {machine}, not x86-64: the pinned kernels do not exist here")
    elif capability != "unknown" and capability.upper() != "AVX2":
        reasons.append(f"torch runs CPU kernels {capability} here (ATEN_CPU_CAPABILITY=avx2 needs a CPU with AVX2)")
    return PinCheck(capability=capability, reasons=tuple(reasons))
