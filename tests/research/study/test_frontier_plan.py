"""The frontier-attention study's plan and its whole-stream view (docs/METHOD.md section 8b)."""

from __future__ import annotations

import pytest

from mechmon_megatron.research.study.analysis import RunData
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.frontier_plan import plan_frontier_campaign
from mechmon_megatron.research.study.frontier_report import whole_stream_view
from mechmon_megatron.research.study.long_plan import plan_campaign


@pytest.mark.parametrize("variant,flag", [("mla", "--multi-latent-attention"), ("qknorm", "--qk-layernorm")])
def test_plan_is_the_detector_studys_grid_on_the_variant(variant, flag):
    runs = plan_frontier_campaign(variant)
    ids = [r.run_id for r in runs]
    assert ids[:2] == ["healthy-cosine-seed1", "healthy-cosine-seed2"]
    assert sorted(i for i in ids if i.startswith("fa-")) == sorted(
        f"fa-s{s}-on{o}-seed{seed}" for s in (32, 16) for o in (500, 2000) for seed in (1, 2, 3))
    assert sorted(i for i in ids if i.startswith("moe-")) == [f"moe-router-lr-seed{s}" for s in (1, 2, 3)]
    assert len(ids) == 18 and all(flag in r.flags for r in runs)
    classic = {r.run_id: r for r in plan_campaign()}
    for run in runs:  # the same runs as the classic study, plus the variant's model flags only
        extra = [f for f in run.flags if f not in classic[run.run_id].flags]
        assert flag in extra and "--train-iters" not in extra and "--lr" not in extra
        assert (run.parent, run.fork_at, run.train_iters) == (classic[run.run_id].parent,
                                                              classic[run.run_id].fork_at,
                                                              classic[run.run_id].train_iters)


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown attention variant 'gdn'"):
        plan_frontier_campaign("gdn")


def test_whole_stream_view_puts_the_whole_stream_where_the_detector_reads_delta2():
    run = plan_frontier_campaign("mla")[0]
    checks = [(20, {"mechmon/attn/delta2_entropy/layer_1": 1.0, "mechmon/attn/delta2_entropy/layer_1/head_0": 1.5,
                    "mechmon/attn/delta2_whole_entropy/layer_1": 2.0,
                    "mechmon/attn/delta2_whole_entropy/layer_1/head_0": 2.5, "mechmon/attn/dw_entropy/layer_1": 3.0})]
    record = CampaignRecord(run=run, data=RunData(steps=[20], loss=[1.0], grad_norm=[1.0], max_attn_logit=[1.0],
                                                  checks=checks), status={})
    view = whole_stream_view(record)
    assert view.data.checks[0][1] == {"mechmon/attn/delta2_entropy/layer_1": 2.0,
                                      "mechmon/attn/delta2_entropy/layer_1/head_0": 2.5,
                                      "mechmon/attn/delta2_whole_entropy/layer_1": 2.0,
                                      "mechmon/attn/delta2_whole_entropy/layer_1/head_0": 2.5,
                                      "mechmon/attn/dw_entropy/layer_1": 3.0}
    assert record.data.checks[0][1]["mechmon/attn/delta2_entropy/layer_1"] == 1.0  # the original is untouched
