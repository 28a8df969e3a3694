"""ZeRO 0/1/2 and expert parallelism give the same mechmon metrics as one process (2 CPU ranks, gloo)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.deepspeed._ds_runs import read_csv_monitor, run_example

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

MECHMON = ["--mechmon-set", "interval=2", "--mechmon-set", "delta=2", "--train-iters", "2"]
STATUS = {"mechmon_alarm", "mechmon_warnings", "mechmon_errors", "mechmon_overhead_ms"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref")
    run_example([*MECHMON, "--monitor-dir", out], nproc=1).check(0)
    return read_csv_monitor(out)


def _mechmon_at(series: dict, step: int) -> dict[str, float]:
    return {k: v[step] for k, v in series.items() if k.startswith("mechmon_") and k not in STATUS and step in v}


def test_reference_has_every_family(reference):
    names = set(reference)
    for layer in (1, 2):
        for metric in ("router_token_entropy", "router_max_vio", "router_weight_similarity", "router_eps",
                       "attn_delta2_entropy", "attn_dw_entropy", "attn_dwk_entropy"):
            assert f"mechmon_{metric}_layer_{layer}" in names, sorted(names)
    assert {"mechmon_alarm", "mechmon_overhead_ms", "Train_lm_loss"} <= names
    assert reference["mechmon_alarm"][2] == 0.0


@pytest.mark.parametrize(
    "label,flags",
    [
        # zero0 and zero1 are slow (fast leg budget): zero2 and ep2_zero2 run in the fast leg.
        pytest.param("zero0", ["--zero-stage", "0"], marks=pytest.mark.slow),
        pytest.param("zero1", ["--zero-stage", "1"], marks=pytest.mark.slow),
        ("zero2", ["--zero-stage", "2"]),
        ("ep2_zero2", ["--zero-stage", "2", "--ep-size", "2"]),
    ],
)
def test_two_ranks_match_one_process(reference, tmp_path: Path, label: str, flags: list):
    run_example([*MECHMON, *flags, "--monitor-dir", tmp_path], nproc=2).check(0)
    got, want = _mechmon_at(read_csv_monitor(tmp_path), 2), _mechmon_at(reference, 2)
    assert set(got) == set(want) and len(want) >= 30, sorted(set(got) ^ set(want))
    bad = {k: (got[k], want[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=1e-4, abs_tol=1e-6)}
    assert not bad, f"{label}: {bad}"


@pytest.mark.slow
def test_zero3_dense_attention_matches_one_process(tmp_path: Path):
    """ZeRO-3 partitions the Q/K weights in place (DeepSpeed's MoE does not support ZeRO-3, so a
    dense FFN): the gathered full weights give the one-process attention metrics."""
    dense = [*MECHMON, "--num-experts", "0"]
    run_example([*dense, "--monitor-dir", tmp_path / "ref"], nproc=1).check(0)
    run_example([*dense, "--zero-stage", "3", "--monitor-dir", tmp_path / "z3"], nproc=2).check(0)
    got, want = _mechmon_at(read_csv_monitor(tmp_path / "z3"), 2), _mechmon_at(read_csv_monitor(tmp_path / "ref"), 2)
    assert set(got) == set(want) and any(k.startswith("mechmon_attn_dw_entropy") for k in want), sorted(want)
    bad = {k: (got[k], want[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=1e-4, abs_tol=1e-6)}
    assert not bad, bad
