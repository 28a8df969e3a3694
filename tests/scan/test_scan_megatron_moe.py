"""A torch_dist GPT-MoE series with grouped-query attention: the stacked router weight and the GQA
split of the fused QKV rows give the online session's values (router weight similarity and eps
included; the routing entropy needs tokens and is absent)."""

from __future__ import annotations

import math
import sys

import pytest

from mechmon_megatron.scan import ScanConfig, run_scan
from mechmon_megatron.session import names
from tests.scan import series as S

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed

MOE_GQA = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
           "--seq-length", "32", "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-aux-loss-coeff", "1e-2", "--micro-batch-size", "2", "--use-cpu-initialization", "--seed", "5",
           "--corpus-max-bytes", "100000", "--num-threads", "1", "--log-interval", "1000"]


def test_moe_gqa_series_matches_the_online_session(tmp_path):
    save, online = tmp_path / "ckpt", tmp_path / "online"
    S.run([sys.executable, str(S.TRAINER), *MOE_GQA, "--train-iters", "30", "--save", str(save), "--save-interval",
           "10", "--mechmon", "--mechmon-interval", "10", "--mechmon-delta", "10", "--mechmon-action", "log",
           "--mechmon-per-head-scalars", "--mechmon-log-dir", str(online)])
    summary = run_scan(ScanConfig(inputs=(str(save),), out=str(tmp_path / "scan"), num_attention_heads=4,
                                  num_query_groups=2, progress=False))
    assert summary["router_layers"] == [1, 2]
    assert summary["heads"]["1"] == {"num_heads": 4, "num_groups": 2, "head_dim": 16}
    got = S.cached_values(tmp_path / "scan")
    want = {int(r["step"]): r["scalars"] for r in S.read_jsonl(online / "mechmon_scalars.jsonl")}
    assert not any("token_entropy" in name for _, name in got)
    compared = 0
    for (step, name), value in got.items():
        if step in want and name in want[step]:
            # Same float32 weights, same float64 kernels (see test_scan_values_equal_the_online_session).
            assert math.isclose(value, want[step][name], rel_tol=1e-9, abs_tol=1e-12), (step, name)
            compared += 1
    routers = {name for _, name in got if name.startswith(f"{names.PREFIX}/router/")}
    assert routers == {names.router(m, L) for m in ("weight_similarity", "eps") for L in (1, 2)}
    assert compared == len(got) > 40  # every scan scalar of the pairs ending at 20 and 30 was written online
