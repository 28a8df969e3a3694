"""Train a tiny model of Hugging Face-style QK-norm attention layers on a DeepSpeed engine (CPU,
gloo) with mechmon attached, and save the module weights after every step.

Usage (one rank per process, rendezvous in the environment):
``python _qk_norm_driver.py OUT STAGE KIND...`` with ZeRO stage STAGE and one layer per KIND
(``_hf_qk_norm.py``). Writes ``OUT/mon/mechmon_scalars.jsonl`` (mechmon, per-head scalars) and,
on rank 0, ``OUT/weights.pt``: ``{step: [{q_proj, k_proj, q_norm, k_norm} per layer]}`` for steps
0..STEPS (the module parameters; gathered first under ZeRO-3).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.deepspeed._hf_qk_norm import HIDDEN, TinyModel  # noqa: E402

STEPS, BATCH, SEQ = 6, 4, 8
SECTION = {"enabled": True, "interval": 2, "delta": 2, "monitors": ["attn"], "per_head_scalars": True,
           "alpha": 1.0}


def _weights(model: TinyModel, stage: int) -> list[dict[str, torch.Tensor]]:
    """Every layer's Q/K projection and norm weights (every rank calls it: a ZeRO-3 gather)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        return [{name: getattr(layer.self_attn, name).weight.detach().clone()
                 for name in ("q_proj", "k_proj", "q_norm", "k_norm")} for layer in model.layers]


def main(out: Path, stage: int, kinds: tuple[str, ...]) -> None:
    import deepspeed

    import mechmon_megatron.deepspeed as mechmon_ds

    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo, no op build
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = TinyModel(kinds)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    ds_config = {"train_batch_size": BATCH * world, "train_micro_batch_size_per_gpu": BATCH,
                 "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 10 ** 6}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    mechmon = mechmon_ds.attach(engine, {**SECTION, "log_dir": str(out / "mon")})
    weights = {0: _weights(model, stage)}
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    for step in range(1, STEPS + 1):
        x, target = torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)
        engine.backward(engine(x, target))
        engine.step()
        weights[step] = _weights(model, stage)
    mechmon.detach()
    if rank == 0:
        torch.save(weights, out / "weights.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), tuple(sys.argv[3:]))
    sys.stdout.flush()
    sys.stderr.flush()
    # As the DeepSpeed example leaves (its exit_now): DeepSpeed keeps its groups in module globals,
    # and a gloo thread outliving them can abort the interpreter's teardown after all is written.
    os._exit(0)
