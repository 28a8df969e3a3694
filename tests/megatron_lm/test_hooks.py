"""The Megatron-LM hooks driving a real session on a real megatron-core GPT-MoE (1 process, gloo).

``megatron.training`` is not in the megatron-core wheel, so the hooks are driven here the way
Megatron-LM's ``train()`` drives them (before the step, after the optimizer step, after a save,
at the exit); the end-to-end run against a real checkout is ``test_e2e.py`` (opt-in).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from mechmon_megatron.adapters import megatron_lm as mlm  # noqa: E402
from mechmon_megatron.adapters.megatron_core import force_param_sync  # noqa: E402
from mechmon_megatron.adapters.megatron_lm.hooks import rollback_reach_line  # noqa: E402
from mechmon_megatron.cli.args import add_mechmon_args, config_from_args  # noqa: E402
from mechmon_megatron.session.alert import ALERT_FILENAME  # noqa: E402

SEQ, VOCAB = 16, 64


def build(num_experts: int = 4, bf16_distributed: bool = False):
    """A DDP-wrapped 2-layer GPT-MoE and a Megatron optimizer, as Megatron-LM's get_model builds.

    ``bf16_distributed``: BF16 parameters, the distributed optimizer (FP32 main shards) and the
    overlapped parameter gather (``--bf16 --use-distributed-optimizer --overlap-param-gather``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if bf16_distributed else torch.float32
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        ffn_hidden_size=64, use_cpu_initialization=True, num_moe_experts=num_experts, moe_router_topk=2,
        moe_token_dispatcher_type="allgather", add_bias_linear=False, bf16=bf16_distributed, params_dtype=dtype,
        pipeline_dtype=dtype,
    )
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    if bf16_distributed:
        model = model.to(dtype)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=bf16_distributed,
                                               overlap_grad_reduce=bf16_distributed,
                                               overlap_param_gather=bf16_distributed)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=dtype, bf16=bf16_distributed,
                        use_distributed_optimizer=bf16_distributed), [ddp]
    )
    return [ddp], optimizer


def train_step(chunks, optimizer, generator):
    chunk = chunks[0]
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    loss = chunk(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1)).mean()
    loss.backward()
    chunk.finish_grad_sync()
    optimizer.step()


def megatron_args(tmp_path, *flags: str) -> argparse.Namespace:
    """Megatron-LM's args namespace: our flags plus the few Megatron fields the hooks read."""
    args = add_mechmon_args(argparse.ArgumentParser()).parse_args(list(flags))
    args.save = str(tmp_path / "ckpt")
    args.load = None
    args.exit_interval = None
    args.tensorboard_dir = None
    args.use_distributed_optimizer = False
    args.overlap_param_gather = False
    args.ckpt_format = "torch"  # Megatron's legacy format: the per-rank JSON files (torch_dist: test_sharded_state.py)
    return args


class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, float(value), step))

    def flush(self):
        pass


def run_like_megatron(hooks, chunks, optimizer, args, start, end, generator):
    """The order of Megatron-LM's train(): train_step -> iteration += 1 -> callbacks -> exit decision."""
    for done in range(start, end):
        hooks.before_step(chunks, done + 1)
        train_step(chunks, optimizer, generator)
        hooks.after_forward_backward()
        iteration = done + 1
        hooks.after_step(chunks, iteration)
        if args.exit_interval and iteration % args.exit_interval == 0:  # checkpoint_and_decide_exit
            os.makedirs(mlm.checkpoint_iter_dir(args.save, iteration), exist_ok=True)
            hooks.after_save(iteration)
            return iteration
    return end


def test_hooks_write_megatron_scalars_and_abort_through_exit_interval(model_parallel, tmp_path):
    chunks, optimizer = build()
    args = megatron_args(tmp_path, "--mechmon", "--mechmon-interval", "2", "--mechmon-delta", "2",
                         "--mechmon-action", "checkpoint-and-abort", "--mechmon-drill-at", "6")
    writer, wandb = Writer(), types.SimpleNamespace(logged=[])
    wandb.log = lambda scalars, step: wandb.logged.append((step, dict(scalars)))
    hooks = mlm.MegatronLMHooks(lambda: args, lambda: writer, lambda: wandb)
    stopped = run_like_megatron(hooks, chunks, optimizer, args, 0, 20, torch.Generator().manual_seed(0))

    assert stopped == 6 and args.exit_interval == 6 and hooks.exit_code == 42
    names = {name for name, _, _ in writer.scalars}
    assert "mechmon/attn/delta2_entropy/layer_1" in names and "mechmon/router/token_entropy/layer_2" in names
    assert {step for _, _, step in writer.scalars} == {2, 4, 6}
    assert any("mechmon/router/token_entropy/layer_1" in s for _, s in wandb.logged)
    state_dir = mlm.checkpoint_iter_dir(args.save, 6)
    state = json.load(open(mlm.state_path(state_dir, 0)))["mechmon"]  # this (only) rank's file, one key
    assert state["version"] == 2 and state["checkpoints"] == [{"iteration": 6, "path": state_dir}]
    assert not os.path.exists(os.path.join(state_dir, mlm.STATE_FILENAME))  # the older single file is gone

    alert_path = hooks.finish_abort()
    assert alert_path == os.path.join(state_dir, ALERT_FILENAME)
    alert = json.load(open(alert_path))
    assert alert["iteration"] == 6 and alert["family"] == "drill" and alert["exit_code"] == 42


def test_start_up_says_when_a_rollback_cannot_reach_the_change_point(tmp_path):
    abort = ("--mechmon", "--mechmon-interval", "20", "--mechmon-action", "checkpoint-and-abort")
    args = megatron_args(tmp_path, *abort)
    args.save_interval = None
    line = rollback_reach_line(args, config_from_args(args))
    assert "no --save-interval" in line and "up to 640 steps" in line  # 28 checks x 20 + (100 - 20)
    args.save = None
    assert "without --save:" in rollback_reach_line(args, config_from_args(args))
    args.save, args.save_interval = str(tmp_path), 100
    assert rollback_reach_line(args, config_from_args(args)) is None
    warn = megatron_args(tmp_path, "--mechmon")
    warn.save_interval = None
    assert rollback_reach_line(warn, config_from_args(warn)) is None  # no abort: nothing to roll back


def test_resume_restores_detectors_from_load(model_parallel, tmp_path):
    chunks, optimizer = build()
    flags = ("--mechmon", "--mechmon-interval", "1", "--mechmon-delta", "1")
    args = megatron_args(tmp_path, *flags)
    hooks = mlm.MegatronLMHooks(lambda: args)
    generator = torch.Generator().manual_seed(1)
    run_like_megatron(hooks, chunks, optimizer, args, 0, 5, generator)
    hooks.after_save(5)
    saved = hooks.session.state_dict()
    assert saved["detector"]["trends"], "the detector should have seen the checks"

    resumed_args = megatron_args(tmp_path, *flags)
    resumed_args.load = args.save
    resumed = mlm.MegatronLMHooks(lambda: resumed_args)
    resumed.before_step(
        build()[0], 6
    )  # fresh chunks (one capture hook per router); Megatron's first train_step after --load at iteration 5
    assert resumed.session.state_dict()["detector"] == json.loads(json.dumps(saved["detector"]))


def test_resume_from_the_older_single_state_file_with_one_notice(model_parallel, tmp_path, caplog):
    """mechmon <= 0.3 wrote the writer's state alone to iter_XXXXXXX/mechmon_state.json."""
    from mechmon_megatron.session import state_format

    chunks, optimizer = build()
    flags = ("--mechmon", "--mechmon-interval", "1", "--mechmon-delta", "1")
    args = megatron_args(tmp_path, *flags)
    hooks = mlm.MegatronLMHooks(lambda: args)
    run_like_megatron(hooks, chunks, optimizer, args, 0, 4, torch.Generator().manual_seed(2))
    hooks.after_save(4)
    directory = mlm.checkpoint_iter_dir(args.save, 4)
    saved = json.load(open(mlm.state_path(directory, 0)))["mechmon"]
    os.remove(mlm.state_path(directory, 0))
    with open(os.path.join(directory, mlm.STATE_FILENAME), "w") as f:  # the old layout: the bare state
        json.dump(saved, f)

    state_format._noticed.discard("megatron-lm-json")  # one notice per process: this test's own
    resumed_args = megatron_args(tmp_path, *flags)
    resumed_args.load = args.save
    resumed = mlm.MegatronLMHooks(lambda: resumed_args)
    with caplog.at_level("WARNING"):
        resumed.before_step(build()[0], 5)
    notices = [r for r in caplog.records if "older format" in r.getMessage()]
    assert len(notices) == 1 and mlm.STATE_FILENAME in notices[0].getMessage()
    assert resumed.session.state_dict()["detector"] == saved["detector"] and saved["detector"]["trends"]


def test_router_capture_only_during_the_train_step(model_parallel, tmp_path):
    chunks, optimizer = build()
    args = megatron_args(tmp_path, "--mechmon", "--mechmon-interval", "2", "--mechmon-monitors", "router")
    hooks = mlm.MegatronLMHooks(lambda: args)
    hooks.before_step(chunks, 2)  # a check step: capture armed for the training forward
    assert hooks.session.capturing
    train_step(chunks, optimizer, torch.Generator().manual_seed(2))
    hooks.after_forward_backward()  # an evaluation forward now must not be captured
    site = hooks.session.router_sites[0]
    captured = site.micro_batches
    with torch.no_grad():
        tokens = torch.zeros(1, SEQ, dtype=torch.long)
        chunks[0](tokens, torch.arange(SEQ).unsqueeze(0), None)
    assert captured > 0 and site.micro_batches == captured


def test_disabled_builds_nothing(model_parallel, tmp_path):
    chunks, _ = build(num_experts=None)
    args = megatron_args(tmp_path)
    hooks = mlm.MegatronLMHooks(lambda: args)
    for iteration in (1, 2):
        hooks.before_step(chunks, iteration)
        hooks.after_forward_backward()
        assert hooks.after_step(chunks, iteration) is False
        hooks.after_save(iteration)
    assert hooks.session is None and args.exit_interval is None and not os.path.exists(args.save)


@pytest.mark.parametrize("weights,synced", [("main", False), ("model", True)])
def test_model_wide_param_sync_only_when_model_weights_are_read(model_parallel, tmp_path, weights, synced):
    """BF16 + distributed optimizer + overlapped param gather: under --mechmon-weights main the
    FP32 main parameters (attention and router) are read, current right after the step, so no
    model-wide parameter gather runs; reading the model weights needs it on every read step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tool", os.path.join(os.path.dirname(__file__), "..", "..", "tools",
                                                                       "measure_main_param_reads.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.allow_cpu_mixed_precision_optimizers()
    chunks, optimizer = build(bf16_distributed=True)
    args = megatron_args(tmp_path, "--mechmon", "--mechmon-interval", "2", "--mechmon-delta", "2",
                         "--mechmon-weights", weights)
    args.use_distributed_optimizer = args.overlap_param_gather = True
    writer = Writer()
    hooks = mlm.MegatronLMHooks(lambda: args, lambda: writer)
    hooks.optimizer = optimizer
    calls: list = []
    sync = chunks[0].start_param_sync
    chunks[0].start_param_sync = lambda *a, force_sync=False, **k: (calls.append(force_sync),
                                                                    sync(*a, force_sync=force_sync, **k))
    run_like_megatron(hooks, chunks, optimizer, args, 0, 4, torch.Generator().manual_seed(3))
    assert hooks.reads.needs_param_sync is synced
    assert (True in calls) is synced, calls
    assert len(hooks.reads.router_reads) == (2 if weights == "main" else 0)  # the two routers' FP32 main weights
    values = {name: value for name, value, step in writer.scalars if step == 4}
    for layer in (1, 2):  # both the attention and the router checks ran on the read weights
        assert f"mechmon/attn/delta2_entropy/layer_{layer}" in values
        assert math.isfinite(values[f"mechmon/router/weight_similarity/layer_{layer}"])
    assert values["mechmon/errors"] == 0.0


def test_force_param_sync_calls_every_ddp_chunk(model_parallel):
    chunks, _ = build(num_experts=None)
    calls = []
    chunks[0].start_param_sync = lambda force_sync=False: calls.append(force_sync)
    assert force_param_sync(chunks + [torch.nn.Linear(2, 2)]) == 1 and calls == [True]


def test_wrapped_training_module_turns_our_exit_into_the_mechmon_code(model_parallel, tmp_path):
    """The four wrapped globals, called in Megatron-LM's order by a loop shaped like its train()."""
    chunks, optimizer = build()
    args = megatron_args(tmp_path, "--mechmon", "--mechmon-interval", "2", "--mechmon-delta", "2",
                         "--mechmon-action", "checkpoint-and-abort", "--mechmon-drill-at", "4",
                         "--mechmon-exit-code", "43")
    training = types.ModuleType("fake_training")
    generator = torch.Generator().manual_seed(4)

    def real_train_step(forward_step_func, data_iterator, model, optimizer_, sched, config, fb, iteration=None):
        train_step(model, optimizer_, generator)

    def real_save_checkpoint(iteration, model, *rest, **kwargs):
        os.makedirs(mlm.checkpoint_iter_dir(args.save, iteration), exist_ok=True)

    def real_train():
        iteration = 0
        while iteration < 10:
            training.train_step(None, None, chunks, optimizer, None, None, None, iteration=iteration)
            iteration += 1
            training.post_training_step_callbacks(chunks, optimizer, None, iteration, None, 0.0)
            if args.exit_interval and iteration % args.exit_interval == 0:
                training.save_checkpoint(iteration, chunks, optimizer, None, 0)
                sys.exit(0)  # what Megatron-LM does after an exit decision
        return iteration

    training.train_step = real_train_step
    training.post_training_step_callbacks = lambda model, opt, sched, iteration, prof, flops, *a: flops
    training.save_checkpoint = real_save_checkpoint
    training.train = real_train
    hooks = mlm.MegatronLMHooks(lambda: args)
    mlm.wrap_training_module(training, hooks)
    with pytest.raises(SystemExit) as exit_info:
        training.train()
    assert exit_info.value.code == 43
    assert os.path.isfile(os.path.join(mlm.checkpoint_iter_dir(args.save, 4), ALERT_FILENAME))
    mlm.unwrap_training_module(training)
    assert training.train is real_train


def test_unsupported_release_names_the_missing_hooks():
    with pytest.raises(RuntimeError, match="post_training_step_callbacks"):
        mlm.wrap_training_module(types.ModuleType("old_training"), mlm.MegatronLMHooks(lambda: None))


def test_unsupported_release_names_the_missing_checkpointing_functions():
    old = types.ModuleType("old_checkpointing")
    old.generate_state_dict = lambda *a, **k: {}
    missing = r"old_checkpointing has no \['_load_global_dist_base_checkpoint'\].*core_v0.16"
    with pytest.raises(RuntimeError, match=missing):
        mlm.wrap_checkpointing_module(old, mlm.MegatronLMHooks(lambda: None))
    assert not hasattr(old.generate_state_dict, "_mechmon_wrapped")  # nothing wrapped


def test_extra_args_provider_chains_an_existing_provider():
    def modelopt(parser):
        parser.add_argument("--modelopt-thing", type=int, default=1)
        return parser

    parser = mlm.extra_args_provider(modelopt)(argparse.ArgumentParser())
    args = parser.parse_args(["--modelopt-thing", "3", "--mechmon", "--mechmon-interval", "7"])
    assert args.modelopt_thing == 3 and args.mechmon and args.mechmon_interval == 7
    assert mlm.add_arguments(argparse.ArgumentParser()).parse_args([]).mechmon is False
