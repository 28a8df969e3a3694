"""Real checkpoint series for the scan tests, written by the example trainers (no mocks).

Model: the example megatron-core GPT, 2 layers, hidden 64, 4 heads (head_dim 16), seq 32,
micro-batch 2, the emulated BF16 flash attention, LR 3e-3 constant after 5 warm-up steps,
saved every ``SAVE_INTERVAL`` = 20 steps with the online monitors on (interval 20, delta 100,
action ``warn``), so the online run's alarms are in its log.

* healthy: ``HEALTHY_ITERS`` steps, no fault;
* FA fault: forked from the healthy run at ``FORK`` (the trainer is bit-identical when resumed,
  tests/megatron_core/test_cpu_trainer.py; the online detector state travels in the checkpoint,
  its weight snapshots do not, so the fork lies a window before the onset), with the amplified
  biased-rounding fault from iteration ``FAULT_ONSET`` (``--fa-fault-strength 512``, all rows)
  until ``FAULT_ITERS``.

Why 20 steps and 512 ulps: this small model's loss reacts to the fault within tens of steps. With
saves every 50 steps the detector's warm-up (5 checks) and two judged checks to cross the threshold
leave no room before the loss is hurt; every 20 steps gives 10 checks of warm-up
(``warmup_checks(20)``) and a check every 20 steps after the onset. The loss of this toy is noisy
(a 20-step mean moves by 1 nat in the healthy run too), so the study's divergence step is chaotic
in the strength and in the stack: measured on an AMD EPYC, divergence at 2048 / 1024 /
768 / 512 ulps: 334 / 435 / 472 / none by 600 (Python 3.11, megatron-core 0.16.1) and 368 / 368 /
369 / 462 (Python 3.12, megatron-core 0.19.2); the scan's first anomaly was 360 in all eight runs.
At 1024 ulps the current leg left 8 steps between the two (and another CI machine, 380 vs 369,
failed the test), so the series uses 512 ulps, where the fault still costs 0.5-1.2 nats against
the healthy run on both stacks, and the test asserts what holds on any of them
(tests/scan/test_scan_megatron.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAINER = REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_mechmon.py"
SAVE_INTERVAL = 20
SCAN_WINDOW = 5
"""Checkpoints per increment window: 100 steps, checked every 20 (see tests/scan/test_scan_megatron.py)."""
HEALTHY_ITERS = 500
FORK = 200
FAULT_ONSET = 301
FAULT_ITERS = 480
FAULT_STRENGTH = 512
HEADS = 4
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", str(HEADS), "--seq-length", "32",
         "--ffn-hidden-size", "128", "--micro-batch-size", "2", "--use-cpu-initialization", "--seed", "3",
         "--corpus-max-bytes", "200000", "--num-threads", "1", "--log-interval", "1000"]
TRAINING = ["--lr", "3e-3", "--lr-warmup-iters", "5", "--lr-decay-style", "constant",
            "--attention-backend", "emulated-lowp-fa"]
# The online session on the scan's schedule: a check every 20 steps over a 100-step window.
ONLINE = ["--mechmon", "--mechmon-interval", str(SAVE_INTERVAL), "--mechmon-delta", str(SCAN_WINDOW * SAVE_INTERVAL),
          "--mechmon-action", "warn", "--mechmon-per-head-scalars"]
_ALARM = re.compile(r"\[mechmon\] ALARM at iteration (\d+): (\S+) layers? ([\d,]+)")


def env() -> dict[str, str]:
    """The trainer's environment: the study's pinned CPU settings, so that the series (and the
    fault run's alarm and divergence steps the tests assert on) are the same on any x86 CPU."""
    from mechmon_megatron.research.reproducible_cpu import pinned_environment

    paths = [str(REPO_ROOT), str(REPO_ROOT / "examples" / "pretrain_scripts"), os.environ.get("PYTHONPATH", "")]
    return pinned_environment(overrides={"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, paths))})


def run(cmd: list[str], timeout_s: float = 300.0) -> str:
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{cmd[:4]} exited {proc.returncode}:\n{output[-4000:]}"
    return output


@dataclass
class Series:
    save: Path
    metrics: list[dict]
    online_alarms: list[tuple[int, str, list[int]]] = field(default_factory=list)
    """(iteration, family, layers) of every alarm the online session raised."""
    online_scalars: dict[int, dict[str, float]] = field(default_factory=dict)
    """The online session's scalars per check step (``mechmon_scalars.jsonl``)."""


def _train(save: Path, iters: int, extra: list[str]) -> Series:
    metrics = save.parent / f"{save.name}_metrics.jsonl"
    online = save.parent / f"{save.name}_online"
    out = run([sys.executable, str(TRAINER), *MODEL, *TRAINING, *ONLINE, "--mechmon-log-dir", str(online),
               "--train-iters", str(iters), "--save", str(save), "--save-interval", str(SAVE_INTERVAL),
               "--metrics-jsonl", str(metrics), *extra])
    alarms = [(int(m.group(1)), m.group(2), [int(x) for x in m.group(3).split(",")]) for m in _ALARM.finditer(out)]
    scalars = {int(r["step"]): r["scalars"] for r in read_jsonl(online / "mechmon_scalars.jsonl")}
    return Series(save=save, metrics=read_jsonl(metrics), online_alarms=alarms, online_scalars=scalars)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_healthy(root: Path) -> Series:
    return _train(root / "healthy", HEALTHY_ITERS, [])


def train_fault(root: Path, healthy: Series) -> Series:
    """The fault run, forked from the healthy run's checkpoint at ``FORK``."""
    save = root / "fault"
    save.mkdir()
    for name in sorted(os.listdir(healthy.save)):
        match = re.fullmatch(r"iter_(\d+)", name)
        if match and int(match.group(1)) <= FORK:
            shutil.copytree(healthy.save / name, save / name)
    (save / "latest_checkpointed_iteration.txt").write_text(str(FORK))
    series = _train(save, FAULT_ITERS, ["--load", str(save), "--fa-fault-strength", str(FAULT_STRENGTH),
                                        "--fa-fault-onset", str(FAULT_ONSET), "--fa-fault-mode", "all_rows"])
    prefix = [r for r in healthy.metrics if r["iteration"] <= FORK]
    series.metrics = prefix + series.metrics
    return series


def loss_divergence(series: Series) -> int | None:
    """The fault study's loss-divergence step (research/study/analysis.py DivergenceRule)."""
    from mechmon_megatron.research.study.analysis import DivergenceRule

    return DivergenceRule().first_step([r["iteration"] for r in series.metrics], [r["lm_loss"] for r in series.metrics])


def cached_values(out: Path) -> dict[tuple[int, str], float]:
    """Every monitor scalar of every pair a scan computed, from its cache (full float64 precision)."""
    values = {}
    for path in sorted((out / "cache").glob("layer_*.jsonl")):
        for line in path.read_text().splitlines()[1:]:
            record = json.loads(line)
            values.update({(record["later"], k): v for k, v in record["scalars"].items()})
    return values


def checkpoint_dirs(save: Path, iterations: list[int]) -> tuple[str, ...]:
    return tuple(str(save / f"iter_{i:07d}") for i in iterations)


def resave(root: Path, healthy: Series, iterations: list[int], layout: list[str], name: str) -> tuple[Path, Path]:
    """``torchrun --nproc-per-node 2 tests/scan/_resave.py``: the healthy checkpoints in another
    layout, as torch_dist and as Megatron-LM legacy files. Returns (dist, legacy) directories."""
    dist, legacy = root / f"{name}_dist", root / f"{name}_legacy"
    sys.path.insert(0, str(REPO_ROOT))
    from tests.megatron_core._torchrun import run_torchrun

    run_torchrun(REPO_ROOT / "tests" / "scan" / "_resave.py",
                 ["--src", healthy.save, "--iterations", ",".join(map(str, iterations)), "--dist-out", dist,
                  "--legacy-out", legacy, "--", *MODEL, "--distributed-backend", "gloo", *layout],
                 nproc=2, timeout_s=240, env={"PYTHONPATH": env()["PYTHONPATH"]}).check()
    return dist, legacy


def export_hf(src: Path, out: Path, fused: bool, num_heads: int = HEADS) -> Path:
    """Export one torch_dist checkpoint of the trainer to a Hugging Face style safetensors folder,
    as a conversion script would: ``model.layers.{i}.self_attn.{q,k,v}_proj.weight`` (separate) or
    one ``qkv_proj.weight`` with rows ``[q | k | v]`` (fused, Phi-3 style), and ``config.json``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    from mechmon_megatron.session.qkv_layout import qkv_row_indices

    key = "decoder.layers.self_attention.linear_qkv.weight"
    meta = FileSystemReader(str(src)).read_metadata().state_dict_metadata[key]
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # one process: intended
        dcp.load(state, storage_reader=FileSystemReader(str(src)), no_dist=True)
    qkv = state[key]  # [layers, rows, hidden]
    head_dim = qkv.shape[1] // (3 * num_heads)
    q_rows, k_rows = qkv_row_indices(num_heads, num_heads, head_dim)
    v_rows = k_rows + head_dim  # [q | k | v] per group, MHA
    tensors = {}
    for i in range(qkv.shape[0]):
        q, k, v = (qkv[i][rows.reshape(-1)] for rows in (q_rows, k_rows, v_rows))
        prefix = f"model.layers.{i}.self_attn"
        if fused:
            tensors[f"{prefix}.qkv_proj.weight"] = torch.cat([q, k, v]).contiguous()
        else:
            tensors.update({f"{prefix}.q_proj.weight": q.contiguous(), f"{prefix}.k_proj.weight": k.contiguous(),
                            f"{prefix}.v_proj.weight": v.contiguous()})
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"num_attention_heads": num_heads, "num_key_value_heads": num_heads,
                                                 "hidden_size": int(qkv.shape[2])}))
    return out
