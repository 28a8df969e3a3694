"""The example trainer with the weights after every optimizer step set by the step number alone.

    python tests/megatron_core/_set_weights_driver.py <trainer flags>   (or under torchrun)

After each ``Trainer.train_step`` (forward, backward, optimizer step) every parameter of the
model becomes ``W(t) = W(0) + t * 1e-2 * N_name`` (1-D norm gammas included, so that their fold
is exercised): ``N_name`` is drawn in full on the CPU from a generator seeded by the parameter's
GLOBAL name (``gpt_trainer.model.global_param_name``) and this rank keeps its tensor-parallel
shard, as ``init_params_layout_independent`` does for ``W(0)``. The weights the monitors read are
then the same for every TP / PP / EP / DP layout, whatever the gradients were: the layout test
compares the monitors' reads and reductions, not megatron-core's training (whose local MLA
under tensor parallelism gives different gradients, docs/METHOD.md section 4b). Only this driver
changes anything; the trainer, the session and the adapter run unchanged.
"""

from __future__ import annotations

import sys
import zlib

import torch

STEP_SCALE = 1e-2


def _direction(model, name: str, param: torch.nn.Parameter, args) -> torch.Tensor:
    from gpt_trainer.model import _tp_coords, global_param_name

    key = global_param_name(model, name, args)
    shape = list(param.shape)
    rank, size = 0, 1
    if getattr(param, "tensor_model_parallel", False):
        rank, size = _tp_coords(param)
        shape[param.partition_dim] *= size
    gen = torch.Generator().manual_seed(7_919 + zlib.crc32(key.encode()))
    full = torch.randn(shape, generator=gen, dtype=torch.float32)
    return full.chunk(size, dim=param.partition_dim)[rank] if size > 1 else full


def _install() -> None:
    from gpt_trainer import attention_variants, loop
    from mechmon_megatron.adapters.megatron_core.discovery import unwrap

    original = loop.Trainer.train_step
    start: dict[int, torch.Tensor] = {}

    def train_step(self):
        params = [(unwrap(chunk), name, param) for chunk in self.model_chunks
                  for name, param in unwrap(chunk).named_parameters()]
        for _, _, param in params:  # W(0): before the first step trained anything
            start.setdefault(id(param), param.detach().clone())
        out = original(self)
        t = self.iteration + 1  # the step this call trained
        with torch.no_grad():
            for model, name, param in params:
                step = _direction(model, name, param, self.args).to(param.device, param.dtype)
                param.copy_(start[id(param)] + t * STEP_SCALE * step)
        return out

    loop.Trainer.train_step = train_step
    # The gradients are never used (the weights are set above), so MLA may run under tensor
    # parallelism here, which the trainer refuses for training (attention_variants.py).
    attention_variants.MLA_TENSOR_PARALLEL_GRADIENTS_OK = True


if __name__ == "__main__":
    _install()
    from gpt_trainer.monitored import run

    sys.exit(run())
