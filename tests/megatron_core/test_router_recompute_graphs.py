"""Activation recompute counts a check step's router tokens once; a CUDA-graphed router is refused.

Real megatron-core GPT-MoE models (local spec, CPU): with ``--recompute-granularity full`` or
``selective`` with ``moe`` in ``--recompute-modules`` the router runs twice per micro-batch (the
forward and the recompute inside the backward); the captured summary equals the one of the same
weights trained without recompute. CUDA graphs need no GPU to be refused: the refusal reads the
flags (parse time) and the model's ``TransformerConfig`` (session build).
"""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from mechmon_megatron.adapters.megatron_core import build_mcore_session  # noqa: E402
from mechmon_megatron.adapters.megatron_core.discovery import find_modules  # noqa: E402
from mechmon_megatron.adapters.megatron_core.sites import router_sites  # noqa: E402
from mechmon_megatron.cli.args import add_mechmon_args, startup_config  # noqa: E402
from mechmon_megatron.monitors.router import RouterEntropySummary  # noqa: E402
from mechmon_megatron.session.collective_guard import guard  # noqa: E402
from mechmon_megatron.session.config import MechmonConfig  # noqa: E402
from mechmon_megatron.session.host_settings import graphed_router  # noqa: E402
from tests.megatron_core.test_router_settings import BATCH, BINS, SEQ, E, _Recorder, _run, build_moe_gpt  # noqa: E402

NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
RECOMPUTE = {
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}


def _summaries(model) -> tuple[list, list]:
    _, found = find_modules([model])
    recorders = [_Recorder(f.module) for f in found]
    sites = router_sites(found, None, reports=True, capture_enabled=lambda: True, guard=guard())
    for site in sites:
        site.num_bins = BINS
    return _run(model, sites, steps=2, seed=5), recorders


@pytest.mark.parametrize("setting", sorted(RECOMPUTE))
def test_recompute_counts_every_token_once(model_parallel, setting):
    plain = build_moe_gpt(**NO_DROPOUT)  # the two runs must not differ by their random draws
    recomputed = build_moe_gpt(**NO_DROPOUT, **RECOMPUTE[setting])
    recomputed.load_state_dict(plain.state_dict())
    want, _ = _summaries(plain)
    got, recorders = _summaries(recomputed)
    for (flat, error), (ref, ref_error), rec in zip(got, want, recorders):
        assert error is None and ref_error is None
        assert len(rec.rows) == 2 * 2, "the router did not run again in the backward: nothing was recomputed"
        summary = RouterEntropySummary.from_flat_tensor(flat, E, BINS)
        assert summary.num_tokens.item() == BATCH * SEQ * 2  # two micro-batches, each token once
        torch.testing.assert_close(flat, ref, rtol=0, atol=1e-9)


def test_without_recompute_each_micro_batch_is_captured_once(model_parallel):
    """The recompute rule leaves the plain training forward alone: two micro-batches, two captures."""
    got, recorders = _summaries(build_moe_gpt())
    assert all(len(rec.rows) == 2 for rec in recorders)
    assert all(RouterEntropySummary.from_flat_tensor(f, E, BINS).num_tokens.item() == BATCH * SEQ * 2 for f, _ in got)


def _megatron_like_parser() -> argparse.ArgumentParser:
    """The CUDA-graph flags as Megatron-LM declares them (dest = TransformerConfig field)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-cuda-graph", action="store_true")
    parser.add_argument("--external-cuda-graph", action="store_true")
    parser.add_argument("--cuda-graph-impl", default="none", choices=["none", "local", "transformer_engine"])
    parser.add_argument("--cuda-graph-scope", nargs="+", default=None)
    add_mechmon_args(parser)
    return parser


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--cuda-graph-impl", "local"], r"--cuda-graph-impl local \(--cuda-graph-scope full\)"),
        (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "moe_router"],
         r"--cuda-graph-impl transformer_engine \(--cuda-graph-scope attn,moe_router\)"),
        (["--enable-cuda-graph"], r"--enable-cuda-graph"),
        (["--external-cuda-graph"], r"--external-cuda-graph"),
    ],
)
def test_cuda_graphed_router_is_refused_at_parse_time(flags, named):
    args = _megatron_like_parser().parse_args(["--mechmon", *flags])
    with pytest.raises(ValueError, match=rf"^--mechmon-monitors router cannot watch a CUDA-graphed MoE router "
                                         rf"\({named}.*--mechmon-monitors attn"):
        startup_config(args)


def test_graphs_without_the_router_or_without_router_monitors_are_accepted():
    parser = _megatron_like_parser()
    startup_config(parser.parse_args(["--mechmon", "--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"]))
    startup_config(parser.parse_args(["--mechmon", "--mechmon-monitors", "attn", "--cuda-graph-impl", "local"]))
    startup_config(parser.parse_args(["--mechmon"]))


def test_cuda_graphed_router_in_the_model_config_is_refused_when_the_session_is_built(model_parallel):
    from megatron.core.transformer import TransformerConfig

    graphed = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                num_moe_experts=E, moe_router_topk=2, cuda_graph_impl="transformer_engine")
    assert graphed_router(graphed) == "--cuda-graph-impl transformer_engine (--cuda-graph-scope full)"
    model = build_moe_gpt(cuda_graph_impl="transformer_engine")  # TE graphs are made by the loop, not the model
    with pytest.raises(ValueError, match=r"CUDA-graphed MoE router \(--cuda-graph-impl transformer_engine"):
        build_mcore_session(MechmonConfig(enabled=True), [model])
    session = build_mcore_session(MechmonConfig(enabled=True, monitors=("attn",)), [model])
    assert session.enabled and not session.router_sites
