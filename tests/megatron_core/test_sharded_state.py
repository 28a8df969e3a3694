"""mechmon's state inside megatron-core distributed checkpoints, one shard per rank (2 gloo ranks).

The example trainer's checkpoints and the Megatron-LM adapter's torch_dist path
(``generate_state_dict`` / ``_load_global_dist_base_checkpoint`` wrapped around a stand-in of
``megatron.training.checkpointing`` that calls the real ``dist_checkpointing``): every rank's own
state is saved as its shard of the ``mechmon`` entry and restored to that rank; older checkpoints
without the entry load their older files with one notice. The driver is
``_sharded_state_driver.py``; the real Megatron-LM loop is ``tests/megatron_lm/test_core_training_loop.py``
(current leg). The only fast test of this capability, so it runs in the fast leg (70 s on the shared 2-core machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.megatron_core._dist_state import saved_state, shard_keys
from tests.megatron_core._torchrun import REPO_ROOT, run_torchrun

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.distributed

DRIVER = REPO_ROOT / "tests" / "megatron_core" / "_sharded_state_driver.py"


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("sharded_state")
    run_torchrun(DRIVER, [out], nproc=2, timeout_s=400).check(0)
    return out, [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_example_trainer_saves_each_ranks_state_in_the_distributed_checkpoint(records):
    out, ranks = records
    iter_dir = str(out / "trainer" / "iter_0000003")
    assert shard_keys(iter_dir) == ["mechmon/shard_0_2", "mechmon/shard_1_2"]
    for rank, record in enumerate(ranks):
        trainer = record["trainer"]
        assert trainer["saved"]["errors"] == 10 + rank
        assert saved_state(iter_dir, rank, 2) == trainer["saved"]  # read with PyTorch's own reader
        assert trainer["loaded"] == trainer["saved"] and trainer["notices"] == []
        # the extra file keeps the other callbacks, RNG and scheduler, and no monitor state
        assert "mechmon" not in trainer["extra_keys"] and trainer["callbacks"] == {"recorder": {"r": rank}}
        older = record["trainer_older"]  # the state in the extra file only: loads, one notice
        assert older["loaded"] == trainer["saved"]
        assert len(older["notices"]) == 1 and "mechmon_extra/rank_R.pt" in older["notices"][0]
    assert shard_keys(str(out / "trainer_older" / "iter_0000003")) == []


def test_megatron_lm_torch_dist_checkpoint_holds_and_restores_each_ranks_state(records):
    out, ranks = records
    iter_dir = str(out / "mlm" / "iter_0000003")
    assert shard_keys(iter_dir) == ["mechmon/shard_0_2", "mechmon/shard_1_2"]
    writer = ranks[1]["mlm"]["saved"]["detector"]  # the last rank holds the detector
    assert writer["trends"] and ranks[0]["mlm"]["saved"]["detector"] is None
    for rank, record in enumerate(ranks):
        mlm = record["mlm"]
        assert saved_state(iter_dir, rank, 2) == mlm["saved"]
        assert not mlm["json_files"]  # torch_dist: nothing written beside the checkpoint
        assert "mechmon" not in mlm["loaded_keys"]  # Megatron's loaded state dict is its own
        resumed = mlm["resumed"]
        assert resumed["errors"] == 20 + rank and resumed["detector"] == mlm["saved"]["detector"]
        # the checkpoint the run resumed from is in the restored list (its state was taken before)
        assert resumed["checkpoints"] == [*mlm["saved"]["checkpoints"], {"iteration": 3, "path": iter_dir}]
        assert mlm["notices"] == []
        older = record["mlm_older"]  # a torch_dist checkpoint without the entry: the per-rank JSON
        assert older["resumed"]["errors"] == 20 + rank and older["resumed"]["detector"] == mlm["saved"]["detector"]
        assert len(older["notices"]) == 1 and f"mechmon_state/rank_{rank:05d}.json" in older["notices"][0]
