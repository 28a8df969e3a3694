"""mechmon's state saved inside megatron-core distributed checkpoints, per rank (torchrun, 2 gloo ranks).

    torchrun --nproc-per-node 2 tests/megatron_core/_sharded_state_driver.py OUT_DIR

A real DDP-wrapped GPT-MoE and Megatron optimizer on every rank (data parallel 2), saved and
loaded with megatron-core's ``dist_checkpointing`` by

1. the example trainer's ``checkpoint.save_checkpoint`` / ``load_checkpoint``: the current layout,
   and the older one (the state in the per-rank extra file only);
2. the Megatron-LM adapter's wrapped ``generate_state_dict`` / ``_load_global_dist_base_checkpoint``
   of a stand-in ``megatron.training.checkpointing`` (megatron-core 0.16 ships no
   ``megatron.training``) that does what Megatron-LM's does with them (real
   ``dist_checkpointing.save`` / ``load``), around a real session trained for 3 checks; and an
   older torch_dist checkpoint without the entry, beside per-rank JSON files.

Each rank writes what it saved and loaded to ``OUT_DIR/rank<R>.json``; the test compares.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples", "pretrain_scripts"))

SEQ, VOCAB = 16, 64


class Notices(logging.Handler):
    """The 'older format' notices this rank logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "older format" in record.getMessage():
            self.messages.append(record.getMessage())


class Scheduler:
    """The LR scheduler's part of the trainer's extra file (its value is not under test)."""

    def state_dict(self) -> dict:
        return {"steps": 3}

    def load_state_dict(self, state: dict) -> None:
        assert state == {"steps": 3}


def build():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        ffn_hidden_size=64, use_cpu_initialization=True, num_moe_experts=4, moe_router_topk=2,
        moe_token_dispatcher_type="allgather", add_bias_linear=False)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [ddp])
    return [ddp], optimizer


def train_step(chunks, optimizer, generator) -> None:
    chunk = chunks[0]
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    chunk(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1)).mean().backward()
    chunk.finish_grad_sync()
    optimizer.step()


def megatron_args(save: str, load=None) -> argparse.Namespace:
    from mechmon_megatron.cli.args import add_mechmon_args

    args = add_mechmon_args(argparse.ArgumentParser()).parse_args(
        ["--mechmon", "--mechmon-interval", "1", "--mechmon-delta", "1"])
    args.save, args.load, args.ckpt_format = save, load, "torch_dist"
    args.exit_interval, args.tensorboard_dir = None, None
    args.use_distributed_optimizer = args.overlap_param_gather = False
    return args


def stand_in_checkpointing(dist_checkpointing) -> types.ModuleType:
    """The two functions of megatron.training.checkpointing the adapter wraps, reduced to what
    Megatron-LM's do with a sharded state dict (the signatures of core_v0.16.1)."""
    module = types.ModuleType("stand_in_checkpointing")

    def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None,
                            optim_sd_kwargs=None, model_sd_kwargs=None, rerun_state=None):
        state = {"args": None, "checkpoint_version": 3.0, "model": model[0].module.sharded_state_dict()}
        if iteration is not None:
            state["iteration"] = iteration
        return state

    def _load_global_dist_base_checkpoint(load_dir, args, rank0, sharded_state_dict, iteration, release,
                                          checkpointing_context=None):
        name = os.path.join(load_dir, f"iter_{iteration:07d}")
        if rank0:
            return dist_checkpointing.load_common_state_dict(name), name, release, "global"
        return dist_checkpointing.load(sharded_state_dict, name), name, release, "global"

    module.generate_state_dict = generate_state_dict
    module._load_global_dist_base_checkpoint = _load_global_dist_base_checkpoint
    return module


def megatron_save(checkpointing, args, chunks, optimizer, iteration: int, dist_checkpointing) -> str:
    """What save_checkpoint does with torch_dist: generate_state_dict, then dist_checkpointing.save."""
    directory = os.path.join(args.save, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    state = checkpointing.generate_state_dict(args, chunks, optimizer, None, None, iteration=iteration,
                                              optim_sd_kwargs=dict(metadata=None))
    dist_checkpointing.save(state, directory)
    return directory


def megatron_load(checkpointing, args, chunks, iteration: int) -> dict:
    """What load_checkpoint does with torch_dist: the rank-0 read, the template, the load."""
    checkpointing._load_global_dist_base_checkpoint(args.load, args, True, None, iteration, False)
    template = checkpointing.generate_state_dict(args, chunks, None, None, None,
                                                 optim_sd_kwargs=dict(metadata=None, is_loading=True))
    state, *_ = checkpointing._load_global_dist_base_checkpoint(args.load, args, False, template, iteration, False)
    chunks[0].module.load_state_dict(state["model"])
    return state


def json_safe(value):
    return json.loads(json.dumps(value))


def main(out: str) -> None:
    from mechmon_megatron.testing.cpu_megatron import enable_cpu_compat

    enable_cpu_compat()
    torch.distributed.init_process_group("gloo")
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from gpt_trainer import checkpoint as trainer_ckpt
    from mechmon_megatron.adapters import megatron_lm as mlm
    from mechmon_megatron.adapters.megatron_lm.hooks import write_state
    from mechmon_megatron.adapters.megatron_lm.install import unwrap_training_module, wrap_checkpointing_module

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    notices = Notices()
    logging.getLogger("mechmon_megatron").addHandler(notices)
    rank = torch.distributed.get_rank()
    record: dict = {}

    # 1. the example trainer
    chunks, optimizer = build()
    train_step(chunks, optimizer, torch.Generator().manual_seed(rank))  # the optimizer has its state
    state = {"version": 2, "detector": None, "checkpoints": [{"iteration": 3, "path": f"p{rank}"}], "errors": 10 + rank}
    root = os.path.join(out, "trainer")
    trainer_ckpt.save_checkpoint(root, 3, chunks, optimizer, Scheduler(), {"callbacks": {"recorder": {"r": rank}}},
                                 monitor_state=state)
    _, extra, loaded = trainer_ckpt.load_checkpoint(root, chunks, optimizer, Scheduler())
    record["trainer"] = {"saved": state, "loaded": loaded, "extra_keys": sorted(extra), "callbacks": extra["callbacks"],
                         "notices": list(notices.messages)}
    older = os.path.join(out, "trainer_older")  # the layout before: the state in the extra file only
    trainer_ckpt.save_checkpoint(older, 3, chunks, optimizer, Scheduler(), {"callbacks": {}, "mechmon": state})
    _, _, loaded = trainer_ckpt.load_checkpoint(older, chunks, optimizer, Scheduler())
    record["trainer_older"] = {"loaded": loaded, "notices": list(notices.messages)}
    notices.messages.clear()

    # 2. the Megatron-LM adapter around a real session
    checkpointing = stand_in_checkpointing(dist_checkpointing)
    save = os.path.join(out, "mlm")
    args = megatron_args(save)
    hooks = mlm.MegatronLMHooks(lambda: args)
    wrap_checkpointing_module(checkpointing, hooks)
    generator = torch.Generator().manual_seed(rank)
    for iteration in range(1, 4):
        hooks.before_step(chunks, iteration)
        train_step(chunks, optimizer, generator)
        hooks.after_forward_backward()
        hooks.after_step(chunks, iteration)
    hooks.session.failures.errors = 20 + rank  # per-rank state that differs between the ranks
    saved = json_safe(hooks.session.state_dict())
    directory = megatron_save(checkpointing, args, chunks, optimizer, 3, dist_checkpointing)
    hooks.after_save(3)
    record["mlm"] = {"saved": saved, "dir": directory,
                     "json_files": os.path.isdir(os.path.join(directory, "mechmon_state"))}
    hooks.close()
    unwrap_training_module(None, checkpointing)

    fresh, _ = build()  # a new run: fresh chunks (one capture hook per router)
    resumed_args = megatron_args(save, load=save)
    resumed = mlm.MegatronLMHooks(lambda: resumed_args)
    wrap_checkpointing_module(checkpointing, resumed)
    loaded_sd = megatron_load(checkpointing, resumed_args, fresh, 3)
    resumed.before_step(fresh, 4)  # the first train_step after --load at iteration 3 builds the session
    record["mlm"].update(resumed=json_safe(resumed.session.state_dict()), loaded_keys=sorted(loaded_sd),
                         notices=list(notices.messages))
    resumed.close()
    unwrap_training_module(None, checkpointing)

    # an older torch_dist checkpoint: no mechmon entry, the per-rank JSON beside it
    older_root = os.path.join(out, "mlm_older")
    older_dir = megatron_save(checkpointing, megatron_args(older_root), chunks, optimizer, 3, dist_checkpointing)
    write_state(older_dir, saved)
    again_args = megatron_args(older_root, load=older_root)
    again = mlm.MegatronLMHooks(lambda: again_args)
    wrap_checkpointing_module(checkpointing, again)
    again_fresh, _ = build()
    megatron_load(checkpointing, again_args, again_fresh, 3)
    again.before_step(again_fresh, 4)
    record["mlm_older"] = {"resumed": json_safe(again.session.state_dict()), "notices": list(notices.messages)}
    again.close()

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
