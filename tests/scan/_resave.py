"""Re-save checkpoints of the example trainer with another model-parallel layout (run under torchrun).

    torchrun --nproc-per-node 2 tests/scan/_resave.py --src SAVE --iterations 40,60 \
        --dist-out OUT_DIST --legacy-out OUT_LEGACY -- <trainer flags, e.g. --tensor-model-parallel-size 2>

Every rank builds the trainer's model in the new layout, loads each iteration of ``--src`` (a
TP=1 ``torch_dist`` series) through megatron-core ``dist_checkpointing`` (which reshards), and
writes it again (a) with ``dist_checkpointing.save`` (``torch_dist``, as the trainer saves) and
(b) in Megatron-LM's legacy ``torch`` format: each rank ``torch.save``s its own
``model.state_dict()`` (its TP shard, its pipeline stage's layers numbered locally) to
``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``, as Megatron-LM's ``save_checkpoint`` does
with ``--ckpt-format torch``. The weights are the source's, bit for bit, so a scan of either copy
must read the same values as a scan of the source.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> int:
    own = argparse.ArgumentParser()
    own.add_argument("--src", required=True)
    own.add_argument("--iterations", required=True)
    own.add_argument("--dist-out", required=True)
    own.add_argument("--legacy-out", required=True)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    mine, trainer_flags = own.parse_args(argv[:split]), argv[split + 1:]

    from megatron.core import dist_checkpointing, parallel_state

    from gpt_trainer.args import parse_args, validate_args
    from gpt_trainer.checkpoint import TRACKER, iteration_dir
    from gpt_trainer.model import build_model, build_transformer_config
    from gpt_trainer.runtime import init_distributed, set_seeds
    from mechmon_megatron.testing.cpu_megatron import enable_cpu_compat

    enable_cpu_compat()
    args = parse_args(trainer_flags)
    init_distributed(args)
    rank = torch.distributed.get_rank()
    validate_args(args, torch.distributed.get_world_size())
    set_seeds(args.seed)
    model = build_model(args, build_transformer_config(args))
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    rank_dir = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if args.pipeline_model_parallel_size > 1 else "")
    iterations = [int(x) for x in mine.iterations.split(",")]
    for iteration in iterations:
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, iteration_dir(mine.src, iteration))
        model.load_state_dict(state["model"])
        out = iteration_dir(mine.dist_out, iteration)
        if rank == 0:
            os.makedirs(out, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict()}, out)
        legacy = os.path.join(iteration_dir(mine.legacy_out, iteration), rank_dir)
        os.makedirs(legacy, exist_ok=True)
        torch.save({"model": model.state_dict(), "iteration": iteration, "checkpoint_version": 3.0, "args": args},
                   os.path.join(legacy, "model_optim_rng.pt"))
        torch.distributed.barrier()
    if rank == 0:
        for root in (mine.dist_out, mine.legacy_out):
            with open(os.path.join(root, TRACKER), "w", encoding="utf-8") as f:
                f.write(str(iterations[-1]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
