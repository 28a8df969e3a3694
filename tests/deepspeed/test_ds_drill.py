"""checkpoint-and-abort drill on 2 DeepSpeed ranks (ZeRO-2, EP=2), then resume with every rank's own state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.deepspeed._ds_runs import read_csv_monitor, run_example, run_example_ranks

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

PROGRESS_AT_6 = {"micro_batches": 6, "tokens": 6 * 2 * 32}
COMMON = ["--zero-stage", "2", "--ep-size", "2", "--save-interval", "2",
          "--mechmon-set", "interval=2", "--mechmon-set", "delta=2", "--mechmon-set", "exit_code=42"]


def test_drill_checkpoint_abort_then_resume(tmp_path: Path):
    save, mon = tmp_path / "ckpt", tmp_path / "mon"
    common = [*COMMON, "--save", save, "--monitor-dir", mon]
    # Each rank a plain process: every rank's own exit code is the agreed one (a launcher would
    # report the first worker's code and end the others).
    drill = run_example_ranks([*common, "--train-iters", "8", "--mechmon-set", "drill_at=6",
                               "--mechmon-set", 'action="checkpoint-and-abort"'], nproc=2)
    for rank, result in enumerate(drill):
        assert result.returncode == 42 and not result.timed_out, (rank, result.output[-3000:])

    assert (save / "latest").read_text().strip() == "global_step6"
    step6 = save / "global_step6"
    files = sorted(p.name for p in step6.iterdir())
    # every rank saved its ZeRO partition and its experts (EP rank 0: experts 0-1, rank 1: 2-3)
    assert any(f.startswith("zero_pp_rank_0_") for f in files) and any(
        f.startswith("zero_pp_rank_1_") for f in files
    ), files
    assert sum("expert_" in f for f in files) == 2 * 4, files  # 2 layers x 4 experts
    alert = json.loads((step6 / "mechmon_alert.json").read_text())
    assert alert["iteration"] == 6 and alert["family"] == "drill" and alert["exit_code"] == 42
    assert alert["last_checkpoint_before_first_warning"]["iteration"] == 4
    states = torch.load(step6 / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert states["mechmon_alert"]["iteration"] == 6
    # DeepSpeed saves client_state from rank 0 only: it holds every rank's own state, gathered
    # at the save (rank 0, the writer, holds the detector; both the checkpoints of steps 2 and 4).
    entry = states["mechmon"]
    assert entry["format"] == "mechmon-per-rank-1" and sorted(entry["ranks"]) == [0, 1]
    assert all(state["version"] == 2 for state in entry["ranks"].values())
    assert entry["ranks"][0]["detector"] is not None and entry["ranks"][1]["detector"] is None
    assert [c["iteration"] for c in entry["ranks"][1]["checkpoints"]] == [2, 4]
    # Rank 1's own error count, made distinct here: the resume must restore rank 1's own entry.
    entry["ranks"][1]["errors"] = 5
    torch.save(states, step6 / "mp_rank_00_model_states.pt")
    # The training loop's own client state (attach(client_state_fn=...)) at the abort: 6 steps of
    # one micro-batch of 2 x 32 tokens per rank (global batch 4 over 2 ranks).
    assert states["example_progress"] == PROGRESS_AT_6, states["example_progress"]

    series = read_csv_monitor(mon)
    assert series["mechmon_alarm"][6] == 1.0 and series["mechmon_alarm"][4] == 0.0
    assert {2, 4, 6} <= set(series["mechmon_router_token_entropy_layer_1"])

    resumed = run_example([*common, "--train-iters", "10", "--load", save], nproc=2)
    resumed.check(0)
    assert "resumed from" in resumed.output and "at step 6" in resumed.output
    assert f"example_progress {json.dumps(PROGRESS_AT_6)}" in resumed.output, resumed.output[-3000:]
    assert (save / "latest").read_text().strip() == "global_step10"
    state = torch.load(save / "global_step10" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert state["example_progress"] == {"micro_batches": 10, "tokens": 10 * 2 * 32}  # 6 restored + 4 trained
    ranks = state["mechmon"]["ranks"]
    assert (ranks[0]["errors"], ranks[1]["errors"]) == (0, 5)  # each rank restored its own state
    # rank 1's restored list (2, 4) plus the save at 8 (a state is taken before its own save is recorded)
    assert [c["iteration"] for c in ranks[1]["checkpoints"]] == [2, 4, 8]
    trends = {(f, layer, member): values for f, layer, member, values in ranks[0]["detector"]["trends"]}
    # checks 2, 4, 6 before the abort and 8, 10 after: the baseline was restored, not re-warmed
    assert max(len(v) for v in trends.values()) == 5, {k: len(v) for k, v in trends.items()}
    assert ("router_entropy", 2, "token_entropy") in trends and ("attn_delta2", 1, "head_0") in trends
