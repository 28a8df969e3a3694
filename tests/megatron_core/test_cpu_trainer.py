"""The example megatron-core trainer on CPU under real torchrun (gloo), tiny models.

Parity: with ``--use-cpu-initialization`` (layout-independent init) and the same seed, the first
iteration's loss of TP=2+SP, PP=2, DP=2 equals the single-process dense run, and EP=2 equals the
single-process MoE run. Resume: save at iteration 2, ``--load``, iteration 3 equals the
uninterrupted run. Callbacks: the hooks fire in order, an ExitRequest saves and exits with its
code, callback state lands in the checkpoint.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from tests.megatron_core._torchrun import REPO_ROOT, run_python, run_torchrun

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_mechmon.py"
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--use-cpu-initialization", "--seed", "1234", "--lr", "1e-3",
        "--corpus-max-bytes", "1000000"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
ITERS = 4
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
          # 64 x TP 2 pads vocab 257 to 384, as 128 x TP 1 does in the single-process runs.
          "--make-vocab-size-divisible-by", "64"]


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train(tmp: Path, name: str, extra: list[str], nproc: int = 2, iters: int = ITERS,
          expected_rc: int = 0) -> list[dict]:
    metrics = tmp / f"{name}.jsonl"
    run_torchrun(SCRIPT, [*TINY, "--train-iters", str(iters), "--metrics-jsonl", metrics, *extra],
                 nproc=nproc, timeout_s=150).check(expected_rc)
    return read_jsonl(metrics) if metrics.exists() else []


def assert_close(actual: float, expected: float, rel: float) -> None:
    assert math.isfinite(actual), actual
    assert abs(actual - expected) <= rel * abs(expected), (actual, expected)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cpu_trainer")


@pytest.fixture(scope="module")
def dense_single(runs_dir) -> list[dict]:
    return train(runs_dir, "dense_single", ["--tensorboard-dir", runs_dir / "tb_single"],
                 nproc=1, iters=10)


@pytest.fixture(scope="module")
def moe_single(runs_dir) -> list[dict]:
    return train(runs_dir, "moe_single", MOE, nproc=1)


@pytest.fixture(scope="module")
def tp2_sp(runs_dir) -> list[dict]:
    return train(runs_dir, "tp2_sp", TP2_SP)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_single_process_loss_decreases(dense_single, runs_dir):
    assert [row["iteration"] for row in dense_single] == list(range(1, 11))
    first, last = dense_single[0]["lm_loss"], dense_single[-1]["lm_loss"]
    assert math.log(257) - 0.5 < first < math.log(257) + 0.5  # ~uniform at init
    assert last < first - 0.3, [row["lm_loss"] for row in dense_single]
    for row in dense_single:
        assert row["grad_norm"] > 0 and row["lr"] > 0 and row["step_time_s"] > 0
    assert any((runs_dir / "tb_single").glob("events.out.tfevents.*"))


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_tp2_sequence_parallel_matches_single(dense_single, tp2_sp):
    assert len(tp2_sp) == ITERS
    assert_close(tp2_sp[0]["lm_loss"], dense_single[0]["lm_loss"], 1e-4)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
@pytest.mark.parametrize("name,extra", [
    ("pp2", ["--pipeline-model-parallel-size", "2"]),
    ("dp2", []),
])
def test_pp2_dp2_match_single(dense_single, runs_dir, name, extra):
    rows = train(runs_dir, name, extra)
    assert len(rows) == ITERS
    assert_close(rows[0]["lm_loss"], dense_single[0]["lm_loss"], 1e-4)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_ep2_moe_matches_single(moe_single, runs_dir):
    rows = train(runs_dir, "ep2", [*MOE, "--expert-model-parallel-size", "2"])
    assert len(rows) == ITERS
    assert_close(rows[0]["lm_loss"], moe_single[0]["lm_loss"], 1e-4)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_resume_matches_uninterrupted(tp2_sp, runs_dir):
    ckpt = runs_dir / "ckpt_tp2"
    saved = train(runs_dir, "tp2_save", [*TP2_SP, "--save", ckpt, "--exit-interval", "2"])
    assert [row["iteration"] for row in saved] == [1, 2]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000002" / "metadata.json").exists()
    resumed = train(runs_dir, "tp2_load", [*TP2_SP, "--load", ckpt])
    assert [row["iteration"] for row in resumed] == [3, 4]
    assert_close(resumed[0]["lm_loss"], tp2_sp[2]["lm_loss"], 1e-5)
    assert_close(resumed[0]["lr"], tp2_sp[2]["lr"], 1e-9)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_iterations_to_skip_consume_the_batch_only(dense_single, runs_dir):
    """Megatron-LM's --iterations-to-skip: no step, no LR-scheduler step, no row; the data of the
    later iterations is the uninterrupted run's (so iteration 5 without 3 and 4 differs from it)."""
    skipped = train(runs_dir, "dense_skip", ["--iterations-to-skip", "3", "4"], nproc=1, iters=10)
    assert [row["iteration"] for row in skipped] == [1, 2, *range(5, 11)]
    assert_close(skipped[1]["lm_loss"], dense_single[1]["lm_loss"], 1e-6)
    assert_close(skipped[2]["lr"], dense_single[2]["lr"], 1e-9)  # the scheduler stood still for 2 steps
    assert skipped[2]["lm_loss"] != dense_single[4]["lm_loss"]


CALLBACK_SCRIPT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {trainer_dir!r})
    from gpt_trainer import ExitRequest, main

    class Recorder:
        name = "recorder"

        def __init__(self, args):
            self.args, self.events, self.steps = args, [], 0

        def on_train_start(self, ctx):
            self.events.append(["start", ctx.iteration, ctx.tensorboard_writer is None])

        def on_step_start(self, iteration):
            self.events.append(["step_start", iteration])

        def on_step_end(self, iteration, ctx):
            self.steps += 1
            self.events.append(["step_end", iteration, ctx.iteration])
            if iteration == self.args.mechmon_stop_at:
                return ExitRequest(save=True, exit_code=3, reason="test stop")

        def on_exit(self, request, checkpoint_dir):
            self.events.append(["exit", request.exit_code, checkpoint_dir is not None])
            with open(self.args.events_out, "w") as f:
                json.dump(self.events, f)

        def state_dict(self):
            return {{"steps": self.steps}}

        def load_state_dict(self, sd):
            self.steps = sd["steps"]

    def provider(parser):
        group = parser.add_argument_group("mechmon test")
        group.add_argument("--mechmon-stop-at", type=int, default=None)
        group.add_argument("--events-out", required=True)
        return parser

    if __name__ == "__main__":  # dist_checkpointing spawns a helper that re-imports __main__
        sys.exit(main(extra_args_providers=[provider],
                      callbacks_factory=lambda a: [Recorder(a)]))
''')


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_callbacks_exit_request_saves_and_exits(runs_dir):
    script = runs_dir / "callback_trainer.py"
    script.write_text(CALLBACK_SCRIPT.format(
        trainer_dir=str(REPO_ROOT / "examples" / "pretrain_scripts")))
    events_out, ckpt = runs_dir / "events.json", runs_dir / "ckpt_cb"
    args = [*TINY, "--num-layers", "2", "--global-batch-size", "2", "--train-iters", "5",
            "--save", ckpt, "--mechmon-stop-at", "2", "--events-out", events_out]
    # Plain python (world size 1): torchrun would turn the worker's exit code 3 into 1.
    run_python(script, args, timeout_s=120).check(expected_returncode=3)
    events = json.loads(events_out.read_text())
    assert events == [["start", 0, True], ["step_start", 1], ["step_end", 1, 1],
                      ["step_start", 2], ["step_end", 2, 2], ["exit", 3, True]]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    extra = torch.load(ckpt / "iter_0000002" / "mechmon_extra" / "rank_00000.pt",
                       weights_only=False)
    assert extra["callbacks"] == {"recorder": {"steps": 2}}
    assert extra["iteration"] == 2


def test_build_indexed_dataset_reads_back_as_byte_stream(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples" / "pretrain_scripts"))
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tools"))
    import build_indexed_dataset

    from gpt_trainer.data import EOD, IndexedStream, SampleSchedule

    texts = ["alpha beta\n", "", "gamma é\n" * 3]
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(text, encoding="utf-8")
    prefix = str(tmp_path / "out" / "bytes")
    assert build_indexed_dataset.main(["--suffix", ".txt", "--output-prefix", prefix,
                                       str(tmp_path)]) == 0
    expected = []
    for text in texts:
        if text:
            expected += list(text.encode("utf-8")) + [EOD]
    stream = IndexedStream(prefix)
    assert len(stream) == len(expected)
    assert stream.window(5, 15).tolist() == expected[5:20]  # crosses a document boundary
    schedule = SampleSchedule(stream, seq_length=8, seed=3)
    first = next(schedule.micro_batches(1, 2, 2, dp_rank=0, dp_size=1))
    assert first["tokens"].shape == (2, 8)
    assert torch.equal(first["tokens"][:, 1:], first["labels"][:, :-1])
