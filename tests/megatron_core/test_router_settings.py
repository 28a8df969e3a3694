"""The router monitors on real megatron-core routers with today's settings.

Sigmoid scores with an expert bias (aux-loss-free, DeepSeek-V3 style), group-limited routing,
capacity factor with token dropping (and padding to capacity), shared experts: the summary the
capture hook builds equals a brute-force computation from the router's own outputs -- the expert
counts are the router's routing map exactly, the entropy is that of the documented distribution
(docs/METHOD.md section 6) computed in fp64 from the router's input and weight. A softmax router
still gives exactly the values of the previous design (top-k of the gating logits).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from mechmon_megatron.adapters.megatron_core.discovery import find_modules, router_settings  # noqa: E402
from mechmon_megatron.adapters.megatron_core.sites import router_sites  # noqa: E402
from mechmon_megatron.monitors.router import RouterEntropySummary, summarize_routing  # noqa: E402
from mechmon_megatron.session.collective_guard import guard  # noqa: E402
from mechmon_megatron.session.router_check import router_output  # noqa: E402

E, K, BINS, SEQ, BATCH, VOCAB = 8, 2, 64, 16, 2, 64

SETTINGS = {
    "softmax": {},
    "sigmoid_expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "sigmoid_bias_groups": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_num_groups=4, moe_router_group_topk=1),
    "softmax_groups": dict(moe_router_num_groups=4, moe_router_group_topk=1),
    "capacity_drop": dict(moe_expert_capacity_factor=0.5),
    "capacity_pad": dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True),
    "sigmoid_shared_experts": dict(moe_router_score_function="sigmoid", moe_shared_expert_intermediate_size=64),
}


def build_moe_gpt(**moe):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8, ffn_hidden_size=64,
        moe_ffn_hidden_size=64, use_cpu_initialization=True, num_moe_experts=E, moe_router_topk=K,
        moe_token_dispatcher_type="allgather", add_bias_linear=False, **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _brute_entropy(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """fp64, straight from the definition: p = softmax(z), or p_e = s(z_e) / sum_j s(z_j)."""
    z = logits.to(torch.float64)
    if score_function == "softmax":
        p = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    elif score_function == "sigmoid":
        p = 1.0 / (1.0 + torch.exp(-z))
    else:
        p = torch.nn.functional.softplus(z).sqrt()
    p = p / p.sum(dim=-1, keepdim=True)
    return -(p * torch.log(p)).sum(dim=-1)


class _Recorder:
    """The router's own input and outputs, from a forward hook (independent of the capture)."""

    def __init__(self, router):
        self.router, self.rows = router, []
        router.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        probs, routing_map = out
        self.rows.append((args[0].detach().clone(), probs.detach().clone(), routing_map.detach().clone()))


def _run(model, sites, steps: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):  # two micro-batches of the check step
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        out = model(tokens, position_ids, attention_mask=None)
        out.float().sum().backward()  # a training step's backward (expert bias counts grad-mode only)
    return [site.take_summary() for site in sites]


def _bias_experts(found, value: float = 2.0):
    # A large bias on expert 0 forces it into every selection: the routing map then differs from
    # the top-k of the (unbiased) scores, and the entropy must not move.
    for item in found:
        if getattr(item.module, "expert_bias", None) is not None:
            with torch.no_grad():
                item.module.expert_bias.zero_()
                item.module.expert_bias[0] = value


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_captured_summary_equals_brute_force_from_the_router_outputs(model_parallel, setting):
    moe = SETTINGS[setting]
    model = build_moe_gpt(**moe)
    _, found = find_modules([model])
    assert [f.layer_number for f in found] == [1, 2]  # shared experts hold no router
    _bias_experts(found)
    recorders = [_Recorder(f.module) for f in found]
    sites = router_sites(found, None, reports=True, capture_enabled=lambda: True, guard=guard())
    for site in sites:
        site.num_bins = BINS
    score = moe.get("moe_router_score_function", "softmax")
    assert all(s.score_function == score for s in sites)
    assert all(s.drops_tokens == ("moe_expert_capacity_factor" in moe) for s in sites)
    results = _run(model, sites)
    for site, rec, (flat, error) in zip(sites, recorders, results):
        assert error is None, error
        assert flat is not None and len(rec.rows) == 2 and site.micro_batches == 0  # taken
        summary = RouterEntropySummary.from_flat_tensor(flat, E, BINS)
        weight = rec.router.weight.detach().to(torch.float64)
        entropies, counts = [], torch.zeros(E, dtype=torch.float64)
        for hidden, probs, routing_map in rec.rows:
            logits = hidden.reshape(-1, hidden.shape[-1]).to(torch.float64) @ weight.T
            entropies.append(_brute_entropy(logits, score))
            routed = routing_map & (probs != 0) if moe.get("moe_pad_expert_input_to_capacity") else routing_map
            counts += routed.sum(dim=0).to(torch.float64)
        h = torch.cat(entropies)
        assert summary.num_tokens.item() == BATCH * SEQ * 2 and summary.num_nonfinite.item() == 0
        assert torch.equal(summary.expert_counts, counts)  # the router's own routing map, exactly
        torch.testing.assert_close(summary.entropy_sum, h.sum(), rtol=1e-5, atol=1e-5)
        expected_hist = torch.bincount(torch.clamp((h * (BINS / math.log(E))).floor(), 0, BINS - 1).long(),
                                       minlength=BINS).to(torch.float64)
        assert torch.equal(summary.histogram, expected_hist)
        if "expert_bias" in setting or "bias_groups" in setting:
            assert torch.equal(summary.expert_counts[0], summary.num_tokens)  # the bias picks expert 0
        if setting == "capacity_drop":
            assert counts.sum() < K * BATCH * SEQ * 2  # assignments were dropped
        if "groups" in setting:
            for _, _, routing_map in rec.rows:  # group_topk 1 of 4 groups of 2: one whole group
                per_group = routing_map.view(-1, 4, 2).sum(dim=-1)
                assert torch.equal(per_group.max(dim=-1).values, torch.full_like(per_group[:, 0], 2))


def test_routing_map_differs_from_top_k_of_logits_under_bias_groups_and_dropping(model_parallel):
    # The point of capturing the map: under these settings top-k of the raw logits is not the load.
    for setting in ("sigmoid_expert_bias", "softmax_groups", "capacity_drop"):
        model = build_moe_gpt(**SETTINGS[setting])
        _, found = find_modules([model])
        _bias_experts(found)
        rec = _Recorder(found[0].module)
        sites = router_sites(found[:1], None, reports=True, capture_enabled=lambda: True, guard=guard())
        (flat, _), = _run(model, sites)
        weight = rec.router.weight.detach()
        logits = torch.cat([h.reshape(-1, h.shape[-1]) @ weight.T for h, _, _ in rec.rows])
        topk_counts = summarize_routing(logits, K, num_bins=BINS).expert_counts
        map_counts = RouterEntropySummary.from_flat_tensor(flat, E, sites[0].num_bins).expert_counts
        assert not torch.equal(topk_counts, map_counts), setting


def test_softmax_router_gives_exactly_the_previous_values(model_parallel):
    """The previous design summarised the gating logits with top-k counts: same bits now."""
    model = build_moe_gpt()
    _, found = find_modules([model])
    seen: dict[int, list[torch.Tensor]] = {}
    for item in found:  # a spy on gating, below the routing wrapper
        original = item.module.gating

        def gating(x, *a, _o=original, _l=item.layer_number, **kw):
            out = _o(x, *a, **kw)
            seen.setdefault(_l, []).append(out.detach().clone())
            return out

        item.module.gating = gating
    sites = router_sites(found, None, reports=True, capture_enabled=lambda: True, guard=guard())
    results = _run(model, sites)
    for site, (flat, error) in zip(sites, results):
        assert error is None
        previous = sum(summarize_routing(x, K, num_bins=site.num_bins).to_flat_tensor()
                       for x in seen[site.layer_number])
        assert torch.equal(flat, previous)


def test_capture_only_when_enabled_and_settings_are_read_from_the_router(model_parallel):
    model = build_moe_gpt(**SETTINGS["capacity_pad"], moe_router_score_function="sigmoid")
    _, found = find_modules([model])
    s = router_settings(found[0].module)
    assert (s.score_function, s.drops_tokens, s.pad_to_capacity) == ("sigmoid", True, True)
    armed = {"on": False}
    sites = router_sites(found, None, reports=True, capture_enabled=lambda: armed["on"], guard=guard())
    assert all(flat is None for flat, _ in _run(model, sites, steps=1))
    armed["on"] = True
    assert all(flat is not None for flat, _ in _run(model, sites, steps=1))
    with pytest.raises(RuntimeError, match="already has a mechmon capture hook"):
        router_sites(found, None, reports=True, capture_enabled=lambda: True, guard=guard())


def test_unknown_score_function_fails_at_startup_naming_it(model_parallel):
    model = build_moe_gpt()
    _, found = find_modules([model])
    found[0].module.score_function = "tanh"  # a future release's score function
    with pytest.raises(ValueError, match="'tanh'.*supported: softmax, sigmoid, sqrtsoftplus"):
        router_sites(found, None, reports=True, capture_enabled=lambda: True, guard=guard())


@pytest.mark.parametrize("out", [torch.randn(4, E), (torch.randn(4, E), torch.ones(4, E))])
def test_unexpected_routing_output_is_a_capture_error_not_a_crash(model_parallel, out):
    """A release whose ``routing`` returns something else: recorded for the check, the forward goes on."""
    model = build_moe_gpt()
    _, found = find_modules([model])
    original = found[0].module.routing
    found[0].module.routing = lambda logits, *a, **kw: (original(logits, *a, **kw), out)[1]
    (site,) = router_sites(found[:1], None, reports=True, capture_enabled=lambda: True, guard=guard())
    logits = torch.randn(4, 1, E)
    assert found[0].module.routing(logits) is out  # the host gets its output unchanged
    summary, error = site.take_summary()
    assert summary is None and isinstance(error, TypeError) and "routes differently" in str(error)


def test_sigmoid_router_has_no_floor_with_one_notice_naming_the_flag(model_parallel, caplog):
    model = build_moe_gpt(**SETTINGS["sigmoid_expert_bias"], moe_expert_capacity_factor=0.5)
    _, found = find_modules([model])
    with caplog.at_level(logging.INFO):
        sites = router_sites(found, None, reports=True, capture_enabled=lambda: True, guard=guard())
    notices = [r.getMessage() for r in caplog.records if "--mechmon-router-min-effective-experts" in r.getMessage()]
    assert len(notices) == 1 and "sigmoid" in notices[0] and "layers 1, 2" in notices[0]
    recorders = [_Recorder(f.module) for f in found]
    results = _run(model, sites)
    flat, _ = results[0]
    out = router_output(sites[0], flat, sites[0].num_bins, entropy_floor=math.log(K))
    scalars = {k: v.value for k, v in out.scalars.items()}
    assert "mechmon/router/token_entropy_floor/layer_1" not in scalars
    (stream,) = [s for s in out.streams if s.family == "router_entropy"]
    assert stream.limit is None
    kept = sum(int(m.sum()) for _, _, m in recorders[0].rows)
    assert scalars["mechmon/router/dropped_fraction/layer_1"] == pytest.approx(1 - kept / (K * 2 * BATCH * SEQ))
    assert scalars["mechmon/router/dropped_fraction/layer_1"] > 0


def test_softmax_router_keeps_its_floor_and_logs_no_notice(model_parallel, caplog):
    model = build_moe_gpt()
    _, found = find_modules([model])
    with caplog.at_level(logging.INFO):
        sites = router_sites(found, None, reports=True, capture_enabled=lambda: True, guard=guard())
    assert not [r for r in caplog.records if "min-effective-experts" in r.getMessage()]
    (flat, _), _ = _run(model, sites)
    out = router_output(sites[0], flat, sites[0].num_bins, entropy_floor=math.log(K))
    assert out.scalars["mechmon/router/token_entropy_floor/layer_1"].value == pytest.approx(math.log(K))
    assert "mechmon/router/dropped_fraction/layer_1" not in out.scalars
    (stream,) = [s for s in out.streams if s.family == "router_entropy"]
    assert stream.limit == pytest.approx(math.log(K))


# -- the example trainer with today's router flags, end to end ---------------------------------

TRAINER = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--num-experts", str(E), "--moe-router-topk",
           str(K), "--lr", "1e-3", "--train-iters", "4", "--corpus-max-bytes", "200000", "--seed", "7"]
DEEPSEEK_LIKE = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                 "--moe-expert-capacity-factor", "1.0", "--moe-shared-expert-intermediate-size", "32",
                 "--moe-router-load-balancing-type", "none"]


def _trainer_module():
    from gpt_trainer import args as trainer_args  # installed with the package (setup.py)
    from gpt_trainer import model as trainer_model

    return trainer_args, trainer_model


def test_trainer_without_the_router_flags_builds_todays_config():
    from megatron.core.transformer import TransformerConfig

    trainer_args, trainer_model = _trainer_module()
    args = trainer_args.build_parser().parse_args(TRAINER)
    config = trainer_model.build_transformer_config(args)
    defaults = {f: TransformerConfig.__dataclass_fields__[f].default for f in (
        "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
        "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax", "moe_expert_capacity_factor",
        "moe_pad_expert_input_to_capacity", "moe_shared_expert_intermediate_size")}
    assert {f: getattr(config, f) for f in defaults} == defaults
    flagged = trainer_model.build_transformer_config(trainer_args.build_parser().parse_args([*TRAINER, *DEEPSEEK_LIKE]))
    assert (flagged.moe_router_score_function, flagged.moe_router_enable_expert_bias, flagged.moe_router_num_groups,
            flagged.moe_router_group_topk, flagged.moe_expert_capacity_factor,
            flagged.moe_shared_expert_intermediate_size) == ("sigmoid", True, 4, 2, 1.0, 32)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_trainer_with_a_deepseek_like_router_end_to_end(tmp_path):
    import json

    from tests.megatron_core._torchrun import REPO_ROOT, run_python

    script = REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_mechmon.py"
    log_dir = tmp_path / "log"
    result = run_python(script, [*TRAINER, *DEEPSEEK_LIKE, "--mechmon", "--mechmon-interval", "2",
                                 "--mechmon-delta", "1", "--mechmon-monitors", "router",
                                 "--mechmon-log-dir", log_dir], timeout_s=180)
    result.check()
    notices = [line for line in result.output.splitlines() if "--mechmon-router-min-effective-experts" in line]
    assert len(notices) == 1 and "sigmoid" in notices[0] and "layers 1, 2" in notices[0]
    rows = [json.loads(line) for line in (log_dir / "mechmon_scalars.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        scalars = row["scalars"]
        for layer in (1, 2):
            h = scalars[f"mechmon/router/token_entropy/layer_{layer}"]
            assert 0 < h <= math.log(E) + 1e-9
            assert f"mechmon/router/token_entropy_floor/layer_{layer}" not in scalars
            assert 0 <= scalars[f"mechmon/router/dropped_fraction/layer_{layer}"] < 1
            assert scalars["mechmon/errors"] == 0
