"""Launch the DeepSpeed example under torchrun for the tests, and read its CSV monitor files."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence

from tests.megatron_core._torchrun import REPO_ROOT, TorchrunResult, run_ranks, run_torchrun

SCRIPT = REPO_ROOT / "examples" / "pretrain_scripts" / "deepspeed_moe_mechmon.py"
JOB_NAME = "deepspeed_moe_mechmon"  # csv_monitor.job_name of ds_config_mechmon.json
# Tiny GPT-MoE: 2 layers, GQA (4 heads, 2 kv heads), 4 experts top-2. No token dropping and no
# aux loss, so 1 process and 2 data-parallel processes train the same model step for step.
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2",
         "--ffn-hidden-size", "64", "--seq-length", "32", "--num-experts", "4", "--topk", "2",
         "--no-drop-tokens", "--aux-loss-coeff", "0", "--lr", "1e-3", "--lr-warmup-iters", "1",
         "--global-batch-size", "4", "--corpus-max-bytes", "100000", "--seed", "3",
         "--no-shm-comm-op", "--log-interval", "1000"]
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_example(args: Sequence[str], nproc: int, timeout_s: float = 150.0) -> TorchrunResult:
    return run_torchrun(SCRIPT, [*MODEL, *map(str, args)], nproc=nproc, timeout_s=timeout_s, env=ENV)


def run_example_ranks(args: Sequence[str], nproc: int, timeout_s: float = 150.0) -> list[TorchrunResult]:
    """The same job with each rank a plain process (rendezvous in the environment, as under srun):
    nothing ends a rank when another exits, so each rank's own exit code is its own, and a rank
    left waiting in a collective shows up as a timeout."""
    return run_ranks(SCRIPT, [*MODEL, *map(str, args)], nproc=nproc, timeout_s=timeout_s, env=ENV)


def read_csv_monitor(monitor_dir: Path) -> dict[str, dict[int, float]]:
    """``{series name (file stem): {step: value}}`` of a DeepSpeed csv_monitor directory."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted((monitor_dir / JOB_NAME).glob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        out[path.stem] = {int(r[0]): float(r[1]) for r in rows[1:] if r}
    return out
