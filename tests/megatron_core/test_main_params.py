"""FP32 main-parameter reads (adapters/megatron_core/main_params.py) on real megatron-core.

The example trainer runs with real megatron-core optimizers (Float16 with ``--bf16``, the
DistributedOptimizer with DP=2 under torchrun + gloo, FP32) and a probe callback that, after
optimizer steps, compares each attention layer's reader with megatron's own handle of the main
parameter (``param.main_param``: the full FP32 copy, or this rank's shard of it plus its range,
assembled over the data-parallel group independently of the reader). No megatron class is mocked;
on CPU the mixed-precision optimizers need one shim (``allow_cpu_mixed_precision_optimizers`` in
``tools/measure_main_param_reads.py``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch

from tests.megatron_core._torchrun import REPO_ROOT, run_python, run_torchrun

pytest.importorskip("megatron.core")

from mechmon_megatron.adapters.megatron_core import main_params  # noqa: E402
from mechmon_megatron.adapters.megatron_core.main_params import (  # noqa: E402
    quantization_of,
    resolve_weight_setting,
    weight_reader,
    weight_readers,
)
from mechmon_megatron.session.collective_guard import guard  # noqa: E402

TOOL = REPO_ROOT / "tools" / "measure_main_param_reads.py"
LAYER = "decoder.layers.0.self_attention.linear_qkv.weight"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--use-cpu-initialization", "--seed", "11", "--lr", "1e-3",
        "--corpus-max-bytes", "200000", "--train-iters", "4", "--lr-warmup-iters", "0"]

WORKER = textwrap.dedent(
    r'''
    import hashlib, importlib.util, json, os, sys
    import torch, torch.distributed as dist
    repo, out_dir, inject = sys.argv[1], sys.argv[2], sys.argv[3] == "inject"
    sys.path[:0] = [repo, os.path.join(repo, "examples", "pretrain_scripts")]
    from mechmon_megatron.testing.cpu_megatron import enable_cpu_compat
    enable_cpu_compat()
    spec = importlib.util.spec_from_file_location("tool", os.path.join(repo, "tools", "measure_main_param_reads.py"))
    tool = importlib.util.module_from_spec(spec); spec.loader.exec_module(tool)
    tool.allow_cpu_mixed_precision_optimizers()
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from mechmon_megatron.adapters.megatron_core import main_params
    from mechmon_megatron.session.collective_guard import PeerFailure, guard
    from mechmon_megatron.adapters.megatron_core.discovery import find_modules
    from gpt_trainer.main import main

    def digest(t):
        return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()

    def truth(param, optimizer, group, row):
        """megatron's own handle of the main param, assembled over the DP group when sharded."""
        if not getattr(param, "main_param_sharded", False):
            return param.main_param.detach()
        owner = [o for o in optimizer.chained_optimizers if isinstance(o, DistributedOptimizer)][0]
        held = None
        if param.main_param is not None:
            span = owner._get_model_param_range_map(param)["param"]
            held = (span.start, span.end, param.main_param.detach().clone())
            row["span"] = [span.start, span.end]
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, held, group=group)
        full = torch.full((param.numel(),), float("nan"))
        covered = 0
        for part in parts:
            if part is not None:
                start, end, values = part
                assert torch.isnan(full[start:end]).all(), "overlapping shards"
                full[start:end] = values
                covered += end - start
        assert covered == param.numel(), (covered, param.numel())
        return full.view(param.shape)

    class Probe:
        name = "probe"
        def __init__(self):
            self.rows, self.initial = [], {}
        def on_train_start(self, ctx):
            self.group = ps.get_data_parallel_group(with_context_parallel=True)
            self.items = []
            self.gathered = []
            for index, item in enumerate(find_modules(ctx.model_chunks)[0]):
                weight = item.module.linear_qkv.weight
                reader, source = main_params.weight_reader(weight, ctx.optimizer, self.group, layer=item.name,
                                                           guard=guard())
                model, model_source = main_params.weight_reader(weight, ctx.optimizer, self.group, layer=item.name,
                                                                setting="model", guard=guard())
                self.items.append((item.name, weight, reader, source, model, model_source))
                if reader.collective:  # a second reader used as the sites use it: layer i on replica i % dp, Q/K rows
                    from mechmon_megatron.session.qkv_layout import qkv_row_indices
                    cfg = item.module.config
                    q, k = qkv_row_indices(cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads,
                                           item.module.hidden_size_per_attention_head)
                    rows = torch.cat([q.reshape(-1), k.reshape(-1)])
                    gathered, _ = main_params.weight_reader(weight, ctx.optimizer, self.group, layer=item.name,
                                                            guard=guard())
                    gathered.configure_use(index % dist.get_world_size(self.group) == dist.get_rank(self.group), rows)
                    self.gathered.append((item.name, weight, gathered, rows))
            guard().create_declared()  # mechmon's own copies of the groups the readers gather over
            for name, _, reader, *_ in self.items:
                self.initial[name] = reader().clone()
            for i, (name, weight, gathered, rows) in enumerate(self.gathered):
                first = gathered()
                self.gathered[i] = (name, weight, gathered, rows, None if first is None else first.clone())
            members = getattr(ctx.optimizer, "chained_optimizers", [ctx.optimizer])
            self.rows.append({"members": [type(m).__name__ for m in members]})
        def on_step_end(self, iteration, ctx):
            if iteration not in (2, 4):
                return
            for name, weight, reader, source, model, model_source in self.items:
                row = {"iteration": iteration, "layer": name, "source": source, "collective": reader.collective,
                       "model_source": model_source, "param_dtype": str(weight.dtype)}
                if inject and iteration == 4 and dist.get_rank(self.group) == 1:
                    original = main_params._local_main_shard
                    def failing(*args):
                        raise RuntimeError("injected out of memory before the gather")
                    main_params._local_main_shard = failing
                try:
                    value = reader()
                except (RuntimeError, PeerFailure) as exc:
                    row["error"] = type(exc).__name__ + ": " + str(exc)
                    self.rows.append(row)
                    continue
                finally:
                    if inject and iteration == 4 and dist.get_rank(self.group) == 1:
                        main_params._local_main_shard = original
                row.update(dtype=str(value.dtype), shape=list(value.shape), param_shape=list(weight.shape),
                           digest=digest(value), moved=not torch.equal(value, self.initial[name]))
                if source == "main":
                    row["equals_truth"] = torch.equal(value, truth(weight, ctx.optimizer, self.group, row))
                    row["bf16_of_main_is_model"] = torch.equal(value.to(weight.dtype), weight.detach())
                    row["differs_from_model"] = not torch.equal(value, weight.detach().float())
                    row["max_abs_diff_model"] = float((value - weight.detach().float()).abs().max())
                    row["max_half_ulp"] = float((torch.finfo(torch.bfloat16).eps / 2 * value.abs()).max())
                else:
                    row["aliases_param"] = value.data_ptr() == weight.data_ptr() and torch.equal(value, weight)
                m = model()
                row["model_read_is_param"] = m.data_ptr() == weight.data_ptr() and m.dtype == weight.dtype
                self.rows.append(row)
            for name, weight, gathered, rows, initial in self.gathered:  # every rank, in order: collectives
                value = gathered()
                ref = truth(weight, ctx.optimizer, self.group, {})
                row = {"gathered": True, "iteration": iteration, "layer": name, "received": value is not None,
                       "traffic": dict(gathered.traffic), "numel": weight.numel(),
                       "qk_numel": rows.numel() * weight.shape[-1]}
                if value is not None:
                    read_rows = torch.zeros(weight.shape[0], dtype=torch.bool)
                    read_rows[rows] = True
                    row["qk_equals_truth"] = torch.equal(value[rows], ref[rows])
                    row["other_rows_zero"] = bool((value[~read_rows] == 0).all())
                    row["moved"] = not torch.equal(value, initial)
                self.rows.append(row)
        def on_exit(self, request, checkpoint_dir):
            rank = dist.get_rank()
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(self.rows, f)

    sys.exit(main(sys.argv[4:], callbacks_factory=lambda args: [Probe()]))
    '''
)


def _run(tmp_path: Path, name: str, flags: list[str], nproc: int, inject: bool = False) -> list[list[dict]]:
    out = tmp_path / name
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER, encoding="utf-8")
    args = [REPO_ROOT, out, "inject" if inject else "plain", *TINY, *flags]
    if nproc == 1:
        run_python(worker, args, timeout_s=150).check()
    else:
        run_torchrun(worker, args, nproc=nproc, timeout_s=150).check()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _members(rows: list[dict]) -> list[str]:
    return next(r["members"] for r in rows if "members" in r)


def _checks(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "members" not in r and "gathered" not in r]


@pytest.fixture(scope="module")
def distopt_dp2(tmp_path_factory) -> list[list[dict]]:
    """One DP=2 run of the distributed optimizer (3 layers: the buffer split puts layer 2's
    linear_qkv.weight half on each rank), with a failure injected on rank 1 at iteration 4."""
    flags = ["--bf16", "--use-distributed-optimizer", "--num-layers", "3"]
    return _run(tmp_path_factory.mktemp("distopt"), "distopt", flags, nproc=2, inject=True)


def _assert_main_rows(rows: list[dict]) -> None:
    assert rows, "the probe recorded nothing"
    for row in rows:
        assert row["source"] == "main", row
        assert row["model_source"] == "model", row
        assert row["dtype"] == "torch.float32" and row["shape"] == row["param_shape"], row
        assert row["equals_truth"], row  # exactly megatron's FP32 main parameter
        assert row["bf16_of_main_is_model"], row  # the model weight is its BF16 rounding
        assert row["max_abs_diff_model"] <= row["max_half_ulp"], row
        assert row["differs_from_model"], row  # and the reader is not the model weight
        assert row["moved"], row  # the optimizer did update it
        assert row["model_read_is_param"], row  # --mechmon-weights model reads the BF16 weight itself


@pytest.mark.distributed
def test_float16_optimizer_bf16_reads_fp32_main(tmp_path):
    (rows,) = _run(tmp_path, "bf16", ["--bf16"], nproc=1)
    assert _members(rows) == ["Float16OptimizerWithFloat16Params"]  # inside a ChainedOptimizer
    rows = _checks(rows)
    _assert_main_rows(rows)
    assert {r["param_dtype"] for r in rows} == {"torch.bfloat16"}
    assert not any(r["collective"] for r in rows)
    assert {r["iteration"] for r in rows} == {2, 4} and len(rows) == 4  # 2 layers x 2 checks


@pytest.mark.distributed
def test_distributed_optimizer_dp2_gathers_full_main_on_every_rank(distopt_dp2):
    rank0, rank1 = distopt_dp2
    assert _members(rank0) == ["DistributedOptimizer"]
    rank0, rank1 = _checks(rank0), _checks(rank1)
    plain0 = [r for r in rank0 if r["iteration"] == 2]
    plain1 = [r for r in rank1 if r["iteration"] == 2]
    _assert_main_rows(plain0 + plain1)
    assert len(plain0) == len(plain1) == 3
    assert all(r["collective"] for r in rank0 + rank1)
    spans = [(a.get("span"), b.get("span")) for a, b in zip(plain0, plain1)]
    assert any(a and b for a, b in spans), spans  # one weight sharded over both ranks
    assert any(bool(a) != bool(b) for a, b in spans), spans  # and one held whole by one rank
    # The same full tensor on both data-parallel ranks.
    assert [r["digest"] for r in plain0] == [r["digest"] for r in plain1]
    # A failure before the gather on rank 1 raises on both ranks instead of hanging the job.
    failed0 = [r for r in rank0 if r["iteration"] == 4]
    failed1 = [r for r in rank1 if r["iteration"] == 4]
    assert failed0 and all(r["error"].startswith("PeerFailure") for r in failed0), failed0
    assert failed1 and all("injected out of memory" in r["error"] for r in failed1), failed1


@pytest.mark.distributed
def test_distributed_optimizer_gathers_qk_rows_to_the_using_replica_only(distopt_dp2):
    """With the sites' use (layer i on replica i % 2, Q and K rows only): the using rank gets
    exactly megatron's FP32 main Q/K rows, the other gets None, and the elements each rank sends
    and receives are those of the gather, not of an all-reduce of the whole weight."""
    ranks = [[r for r in rows if r.get("gathered")] for rows in distopt_dp2]
    for rank, rows in enumerate(ranks):
        assert len(rows) == 3 * 2, rows  # 3 layers x checks at 2 and 4
        for row in rows:
            index = int(re.search(r"layers\.(\d+)\.", row["layer"]).group(1))
            uses = index % 2 == rank
            assert row["received"] == uses, (rank, row)
            reads = 1 + row["iteration"] // 2  # the first read at start-up, then one per check
            traffic = row["traffic"]
            if uses:
                assert row["qk_equals_truth"] and row["other_rows_zero"] and row["moved"], row
                assert traffic["sent"] == 0 and 0 < traffic["received"] <= reads * row["qk_numel"], row
            else:
                assert traffic["received"] == 0 and traffic["sent"] <= reads * row["qk_numel"], row
    # Over both ranks each read moves at most the Q/K rows once (padding aside), where the
    # all-reduce moved the whole weight each way on each rank (2 (n - 1) / n x numel, n = 2).
    for a, b in zip(*ranks):
        reads = 1 + a["iteration"] // 2
        moved = a["traffic"]["received"] + b["traffic"]["received"]
        assert moved <= reads * a["qk_numel"] < reads * 2 * a["numel"], (a, b)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
@pytest.mark.distributed
def test_fp32_training_reads_the_model_weight(tmp_path):
    (rows,) = _run(tmp_path, "fp32", [], nproc=1)
    assert _members(rows) == ["FP32Optimizer"]
    rows = _checks(rows)
    assert rows
    for row in rows:
        assert row["source"] == "model" and not row["collective"], row
        assert row["param_dtype"] == "torch.float32" and row["dtype"] == "torch.float32", row
        assert row["aliases_param"] and row["moved"], row  # the model weight is the optimizer's weight


# ------------------------------------------------------------------ no process group needed
def test_float8_weight_is_refused_naming_layer_and_flag():
    weight = torch.nn.Parameter(torch.randn(8, 4).to(torch.float8_e4m3fn), requires_grad=False)
    assert "float8_e4m3fn" in quantization_of(weight)
    for setting in ("main", "model"):  # no optimizer: the model weight would have to be read
        with pytest.raises(ValueError, match=rf"layer {LAYER}: .*float8_e4m3fn.*--mechmon-weights main"):
            weight_reader(weight, None, layer=LAYER, setting=setting, guard=guard())


def test_integer_weight_is_refused():
    with pytest.raises(ValueError, match=r"layer L: .*torch\.int8.*no documented dequantization"):
        weight_reader(torch.zeros(4, 4, dtype=torch.int8), None, layer="L", guard=guard())


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_weight_with_dequantize_is_dequantized(caplog):
    x = torch.randn(6, 4)
    q = torch.quantize_per_tensor(x, scale=0.05, zero_point=0, dtype=torch.qint8)
    with caplog.at_level(logging.WARNING):
        reader, source = weight_reader(q, None, layer="L", guard=guard())
    assert source == "model" and "dequantized" in reader.reason
    value = reader()
    assert value.dtype == torch.float32 and torch.equal(value, q.dequantize())
    assert "no optimizer given" in caplog.text


class _Scaled(torch.Tensor):
    """A tensor subclass with its own ``dequantize`` (the Transformer Engine QuantizedTensor shape)."""

    scale = 2.0

    def dequantize(self):
        return self.as_subclass(torch.Tensor) * self.scale


def test_tensor_subclass_with_own_dequantize_is_used():
    raw = torch.randn(3, 5)
    weight = raw.as_subclass(_Scaled)
    assert quantization_of(weight) is not None
    reader, source = weight_reader(weight, None, layer="L", setting="model", guard=guard())
    assert source == "model" and torch.equal(reader(), raw * 2.0)


def test_fp32_weight_needs_no_optimizer_and_is_not_copied(caplog):
    weight = torch.nn.Parameter(torch.randn(4, 4))
    with caplog.at_level(logging.INFO, logger=main_params.__name__):
        reader, source = weight_reader(weight, None, layer="L", guard=guard())
    assert source == "model" and reader.collective is False
    assert reader().data_ptr() == weight.data_ptr()
    assert "FP32 parameters" in caplog.text


def test_unrecognised_optimizer_falls_back_with_one_notice(caplog):
    weights = [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16)) for _ in range(3)]
    optimizer = torch.optim.SGD(weights, lr=0.1)  # not a megatron-core optimizer
    with caplog.at_level(logging.WARNING, logger=main_params.__name__):
        resolved = weight_readers([(f"layer{i}", w) for i, w in enumerate(weights)], optimizer, guard=guard())
    assert [source for _, source in resolved] == ["model"] * 3
    assert all(r().dtype == torch.bfloat16 for r, _ in resolved)
    notices = [rec for rec in caplog.records if "not recognised" in rec.getMessage()]
    assert len(notices) == 1 and "SGD" in notices[0].getMessage()


def _load_tool():
    spec = importlib.util.spec_from_file_location("measure_main_param_reads", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_chained_optimizer_finds_the_member_that_owns_the_param():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params

    from mechmon_megatron.testing.cpu_megatron import enable_cpu_compat

    enable_cpu_compat()
    _load_tool().allow_cpu_mixed_precision_optimizers()
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16)
    dense = [torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16)) for _ in range(2)]
    expert = [torch.nn.Parameter(torch.randn(5, 4, dtype=torch.bfloat16))]
    members = [Float16OptimizerWithFloat16Params(torch.optim.Adam(ps, lr=1e-3), config, None, None)
               for ps in (dense, expert)]
    chained = ChainedOptimizer(members)
    for param in (*dense, *expert):
        reader, source = weight_reader(param, chained, layer="L", guard=guard())
        assert source == "main" and reader() is not param
        assert reader().dtype == torch.float32 and torch.equal(reader(), param.main_param)
    stray = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.bfloat16))  # trained by neither
    reader, source = weight_reader(stray, chained, layer="L", guard=guard())
    assert source == "model" and "not among the optimizer's 16-bit parameters" in reader.reason


def test_weight_setting_values():
    assert resolve_weight_setting(None) == "main"
    assert resolve_weight_setting("MODEL") == "model"
    with pytest.raises(ValueError, match=r"--mechmon-weights must be one of \['main', 'model'\], got 'fp8'"):
        resolve_weight_setting("fp8")


def test_cpu_shim_is_idempotent():
    tool = _load_tool()
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    tool.allow_cpu_mixed_precision_optimizers()
    first = Float16OptimizerWithFloat16Params.__init__
    tool.allow_cpu_mixed_precision_optimizers()
    assert Float16OptimizerWithFloat16Params.__init__ is first
    assert torch.zeros(1).type() == "torch.FloatTensor"  # Tensor.type is untouched outside


def test_monitored_bf16_job_with_distributed_optimizer_reads_main_params_on_every_dp_rank(tmp_path):
    """The session end to end: BF16 GPT-MoE, FP32 main parameters sharded over DP=2 by the
    distributed optimizer. Every DP rank joins the collective reads (the per-head and full-matrix
    work is spread over both; the Q/K rows go to the using replica, the router weights to the
    reporting rank), nothing hangs, and the snapshot budget counts 4-byte elements."""
    script = REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_mechmon.py"
    args = [*TINY[:-4], "--train-iters", "8", "--global-batch-size", "4", "--bf16", "--use-distributed-optimizer",
            "--num-experts", "4", "--moe-router-topk", "2",
            "--mechmon", "--mechmon-interval", "2", "--mechmon-delta", "2", "--mechmon-log-dir", str(tmp_path)]
    result = run_torchrun(script, args, nproc=2, timeout_s=240).check(0)
    assert "reading the model weights, not FP32 main parameters" not in result.output
    # 2 layers; layer 1 on replica 0, layer 2 on replica 1 (per head and full matrix, tp = 1:
    # one shared copy): (4 + 4) heads x 16 x 64 elements x 4 bytes = 32 KiB per rank.
    budgets = sorted(set(re.findall(r"mechmon: snapshots hold ([0-9.]+) MiB on cpu \(rank (\d)",
                                                  result.output)), key=lambda b: b[1])
    assert [rank for _, rank in budgets] == ["0", "1"]
    assert all(float(mib) == pytest.approx(8 * 16 * 64 * 4 / 2**20, rel=1e-3) for mib, _ in budgets), budgets
    rows = [json.loads(line) for line in (tmp_path / "mechmon_scalars.jsonl").read_text().splitlines()]
    last = rows[-1]["scalars"]
    for layer in (1, 2):
        assert f"mechmon/attn/delta2_entropy/layer_{layer}" in last and f"mechmon/attn/dw_entropy/layer_{layer}" in last
        # the router weight: its FP32 main shards gathered to the reporting rank before the check
        assert f"mechmon/router/weight_similarity/layer_{layer}" in last
    assert last["mechmon/errors"] == 0.0


@pytest.mark.slow  # ~30 s each on the shared machine (fast-leg budget); the layouts test covers the reads
@pytest.mark.parametrize("variant", [
    ["--qk-layernorm"],
    ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
     "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--attention-backend", "torch"],
], ids=["qk_norm", "mla"])
def test_bf16_distributed_optimizer_reads_qk_norm_and_mla_main_params(tmp_path, variant):
    """QK-norm gammas and every MLA projection and latent gamma are read from the FP32 main
    parameters sharded over DP=2 (collective reads on every DP rank, in site order): the checks
    run with no monitor error and every head has its Delta2 value."""
    script = REPO_ROOT / "examples" / "pretrain_scripts" / "pretrain_gpt_mechmon.py"
    args = [*TINY[:-4], "--train-iters", "6", "--global-batch-size", "4", "--bf16", "--use-distributed-optimizer",
            "--num-experts", "4", "--moe-router-topk", "2", *variant, "--mechmon-per-head-scalars",
            "--mechmon", "--mechmon-interval", "2", "--mechmon-delta", "2", "--mechmon-log-dir", str(tmp_path)]
    result = run_torchrun(script, args, nproc=2, timeout_s=240).check(0)
    assert "reading the model weights, not FP32 main parameters" not in result.output
    rows = [json.loads(line) for line in (tmp_path / "mechmon_scalars.jsonl").read_text().splitlines()]
    last = rows[-1]["scalars"]
    assert last["mechmon/errors"] == 0.0
    for layer in (1, 2):
        for head in range(4):
            value = last[f"mechmon/attn/delta2_entropy/layer_{layer}/head_{head}"]
            assert math.isfinite(value) and value > 0
