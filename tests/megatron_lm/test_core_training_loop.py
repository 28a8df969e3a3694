"""The real Megatron training loop of the installed megatron-core (``megatron.training.pretrain``).

megatron-core wheels from 0.18 on ship ``megatron.training``; the current leg (``make
test-current``, megatron-core 0.19) runs these tests, the fast leg (0.16.1, no
``megatron.training``) skips them. No Megatron-LM checkout: the script is our own provider
script ``examples/pretrain_scripts/pretrain_gpt_core.py``, unmodified, started the zero-patch way
(``mechmon-run`` through the CPU launcher of the testing package) under real torchrun with two gloo
ranks, tensor parallel 2 with sequence parallelism (and one pipeline-parallel run), a tiny
GPT-MoE on mock data.

Drill at 20 with checkpoint-and-abort: Megatron's own save at 20 on every rank (torch_dist, the
default format: mechmon's state is inside it, one shard per rank), the alert, every rank leaving
with the exit code; TensorBoard events read back; a resume from that checkpoint continues the
detector's saved history.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import re

import pytest
from tiny_gpt_flags import TINY_GPT_MOE

from tests.megatron_core._dist_state import saved_state, shard_keys
from tests.megatron_core._torchrun import REPO_ROOT, run_torchrun_module

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.training") is None,
        reason="megatron.training ships with megatron-core >= 0.18 (make test-current)",
    ),
]

SCRIPT = str(REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_core.py")
CPU_LAUNCHER = "mechmon_megatron.testing.megatron_lm_cpu"  # mechmon-run plus the CPU layer
EXIT_CODE = 43  # not the default (42): the flag must reach every rank
ENV = {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # Megatron requires it with TP

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def pretrain(workdir: str, extra: list[str], tag: str, layout: list[str] = TP2, data_path: str | None = None):
    """torchrun, 2 ranks, of the provider script (mock data unless ``data_path``, an indexed
    dataset prefix); per-rank logs under ``workdir/logs/tag``."""
    model = TINY_GPT_MOE if data_path is None else [f for f in TINY_GPT_MOE if f != "--mock-data"]
    data = [] if data_path is None else ["--data-path", data_path, "--data-cache-path", os.path.join(workdir, "cache")]
    args = [SCRIPT, *model, *data, *layout, "--train-iters", "30", "--save", os.path.join(workdir, "ckpt"),
            "--tensorboard-dir", os.path.join(workdir, "tb", tag), *extra]
    logs = os.path.join(workdir, "logs", tag)
    result = run_torchrun_module(CPU_LAUNCHER, args, nproc=2, timeout_s=420, env=ENV,
                                 torchrun_args=["--log-dir", logs, "--redirects", "3", "--tee", "3"])
    return result, [_rank_log(logs, rank) for rank in range(2)]


def _rank_log(logs: str, rank: int) -> str:
    paths = glob.glob(os.path.join(logs, "**", "attempt_0", str(rank), "std*.log"), recursive=True)
    assert paths, f"no torchrun log of rank {rank} under {logs}"
    return "".join(open(path).read() for path in sorted(paths))


def scalars(tb_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(files[0], size_guidance={"scalars": 0})
    events.Reload()
    return events


def trends(state: dict) -> dict:
    return {tuple(entry[:3]): entry[3] for entry in state["detector"]["trends"]}


def test_drill_checkpoints_aborts_every_rank_and_resumes(tmp_path):
    workdir = str(tmp_path)
    ckpt = os.path.join(workdir, "ckpt")
    result, rank_logs = pretrain(workdir, ["--mechmon-drill-at", "20", "--mechmon-action", "checkpoint-and-abort",
                                           "--mechmon-exit-code", str(EXIT_CODE)], "abort")
    assert result.returncode != 0 and not result.timed_out, result.output[-6000:]
    # torchrun ends the job on the first worker's exit: it reports that worker's own code.
    assert re.search(rf"exitcode\s*:\s*{EXIT_CODE}\b", result.output), result.output[-4000:]
    for rank, log in enumerate(rank_logs):  # every rank reached the agreed exit after the save
        assert f"checkpoint-and-abort at iteration 20: exiting with code {EXIT_CODE}" in log, (rank, log[-3000:])

    # Megatron's own save at the abort iteration (torch_dist: both TP ranks wrote shards), no other.
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "20"
    assert set(os.listdir(ckpt)) == {"iter_0000020", "latest_checkpointed_iteration.txt"}
    iter_dir = os.path.join(ckpt, "iter_0000020")
    for rank in range(2):
        assert glob.glob(os.path.join(iter_dir, f"__{rank}_*.distcp")), os.listdir(iter_dir)
    # mechmon's state is inside Megatron's distributed checkpoint, one shard per rank, and nothing
    # beside it (read back with PyTorch's own reader, no megatron-core load)
    assert shard_keys(iter_dir) == ["mechmon/shard_0_2", "mechmon/shard_1_2"]
    assert not os.path.exists(os.path.join(iter_dir, "mechmon_state"))
    saved = saved_state(iter_dir, 1, 2)
    assert saved["version"] == 2 and saved["detector"]["trends"] and saved_state(iter_dir, 0, 2)["detector"] is None
    alert = json.load(open(os.path.join(iter_dir, "mechmon_alert.json")))
    assert (alert["iteration"], alert["family"], alert["exit_code"]) == (20, "drill", EXIT_CODE)
    assert alert["checkpoint_dir"] == iter_dir

    events = scalars(os.path.join(workdir, "tb", "abort"))
    tags = set(events.Tags()["scalars"])
    for name in ("mechmon/attn/delta2_entropy/layer_1", "mechmon/attn/dw_entropy/layer_2",
                 "mechmon/router/token_entropy/layer_2", "mechmon/router/load_fraction_max/layer_1",
                 "mechmon/alarm", "lm loss"):
        assert name in tags, sorted(tags)
    entropy = events.Scalars("mechmon/attn/delta2_entropy/layer_1")
    assert [e.step for e in entropy] == [5, 10, 15, 20]
    assert all(math.isfinite(e.value) and e.value > 0.0 for e in entropy)
    assert {e.step: e.value for e in events.Scalars("mechmon/alarm")}[20] == 1.0
    assert max(e.value for e in events.Scalars("mechmon/alarm") if e.step < 20) == 0.0

    result, rank_logs = pretrain(workdir, ["--load", ckpt], "resume")
    assert result.returncode == 0 and not result.timed_out, result.output[-6000:]
    assert all("restored detector state from" in log for log in rank_logs)
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "30"
    # The writer (the last rank, 1) holds the detectors: its own shard of the checkpoint's entry.
    saved, resumed = (trends(saved_state(os.path.join(ckpt, f"iter_{t:07d}"), 1, 2)) for t in (20, 30))
    assert saved.keys() == resumed.keys()
    for key, history in saved.items():  # the resumed run extended the saved history by 25 and 30
        assert resumed[key][: len(history)] == history and len(resumed[key]) == len(history) + 2, key
    entropy = scalars(os.path.join(workdir, "tb", "resume")).Scalars("mechmon/attn/delta2_entropy/layer_1")
    assert [e.step for e in entropy] == [25, 30]


def write_indexed_dataset(prefix: str, documents: int = 300, vocab: int = 256) -> str:
    """A Megatron indexed dataset (``prefix.bin`` / ``.idx``) of random token documents."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        length = int(rng.integers(20, 200))
        builder.add_document(torch.from_numpy(rng.integers(1, vocab, size=length).astype(np.int32)), [length])
    builder.finalize(prefix + ".idx")
    return prefix


def test_pipeline_stages_on_indexed_data_each_report_their_layer_and_abort_together(tmp_path):
    """PP=2 on an indexed dataset (``--data-path``, GPTDataset): layer 1 lives on the first stage,
    layer 2 on the last (the writer); both layers' scalars reach TensorBoard and both stages leave
    at the agreed iteration."""
    data = write_indexed_dataset(str(tmp_path / "tokens_text_document"))
    result, rank_logs = pretrain(str(tmp_path), ["--mechmon-drill-at", "10", "--mechmon-action",
                                                 "checkpoint-and-abort"], "pp2", layout=PP2, data_path=data)
    assert re.search(r"exitcode\s*:\s*42\b", result.output), result.output[-4000:]
    assert all("checkpoint-and-abort at iteration 10: exiting with code 42" in log for log in rank_logs)
    events = scalars(os.path.join(tmp_path, "tb", "pp2"))
    for layer in (1, 2):
        for family in ("attn/delta2_entropy", "router/token_entropy"):
            assert [e.step for e in events.Scalars(f"mechmon/{family}/layer_{layer}")] == [5, 10], (family, layer)
    assert os.path.isdir(os.path.join(tmp_path, "ckpt", "iter_0000010"))
    assert "building GPTDataset train" in rank_logs[0]  # the provider built indexed-data datasets (rank 0 prints)


def test_bad_mechmon_flag_stops_every_rank_before_the_model_is_built(tmp_path):
    result, rank_logs = pretrain(str(tmp_path), ["--mechmon-action", "explode"], "bad_flag")
    assert re.search(r"exitcode\s*:\s*2\b", result.output), result.output[-4000:]
    # Every rank refuses at start-up, but once the first exits with 2 torchrun stops the others, so
    # under load a slower rank may be stopped before it logs its own refusal: no rank builds a model.
    assert any("--mechmon-action must be one of" in log for log in rank_logs), rank_logs[0][-3000:]
    for log in rank_logs:
        assert "number of parameters" not in log and "building GPT model" not in log
    assert not os.path.exists(os.path.join(tmp_path, "ckpt"))
