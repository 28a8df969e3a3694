"""Run the DeepSpeed example with gradient accumulation and record, per check, what the router
monitors summed and an independent reference computed from the gate's own inputs.

Usage (one rank per process, rendezvous in the environment): ``python _ga_driver.py OUT.json
EXAMPLE_ARGS...``. The example's ``main`` runs unchanged; ``attach`` is wrapped to add, on each
``TopKGate``, a forward pre-hook that recomputes the gate logits of every training forward
(``input @ wg.weight.T``) and reduces them here, without mechmon's code, to the token count, the
entropy sum of the softmax and the top-k expert counts of each iteration; and to record the
vector each router site passes to its all-reduce at a check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_scripts" / "deepspeed_moe_mechmon.py"


def _reference_hook(layer: int, engine, topk: int, store: dict):
    def hook(module, args) -> None:
        if not module.training:
            return
        x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        logits = x @ module.wg.weight.detach().double().t()
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            logits = logits[args[1].reshape(-1) != 0]
        p = torch.softmax(logits, dim=-1)
        entropy = -(p * torch.log(p)).sum(dim=-1)
        counts = torch.zeros(logits.shape[-1], dtype=torch.float64)
        counts.index_add_(0, logits.topk(topk, dim=-1).indices.reshape(-1),
                          torch.ones(logits.shape[0] * topk, dtype=torch.float64))
        entry = store[f"{int(engine.global_steps) + 1}/{layer}"]  # the iteration this forward trains
        entry["micro_batches"] += 1
        entry["tokens"] += int(logits.shape[0])
        entry["entropy_sum"] += float(entropy.sum())
        entry["counts"] = [a + float(b) for a, b in zip(entry["counts"] or [0.0] * len(counts), counts)]

    return hook


def main(out: str, argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("_ds_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    import mechmon_megatron.deepspeed as mechmon_ds
    from mechmon_megatron.adapters.deepspeed.gate_capture import find_gates

    reference: dict = defaultdict(lambda: {"micro_batches": 0, "tokens": 0, "entropy_sum": 0.0, "counts": None})
    reduced: dict[str, list[float]] = {}
    real_attach = mechmon_ds.attach

    def attach(engine, *args, **kwargs):
        attached = real_attach(engine, *args, **kwargs)
        for layer, (_, gate) in enumerate(find_gates(engine.module), start=1):
            gate.register_forward_pre_hook(_reference_hook(layer, engine, int(gate.k), reference))
        for site in attached.session.router_sites:
            def record(vector, _site=site, _inner=site.reduce_sum):
                total = _inner(vector)
                reduced[f"{int(engine.global_steps)}/{_site.layer_number}"] = total.tolist()
                return total
            site.reduce_sum = record
        return attached

    mechmon_ds.attach = attach
    code = example.main(argv)
    Path(out).write_text(json.dumps({"reference": reference, "reduced": reduced}))
    return code


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the example script leaves (its exit_now): no interpreter teardown
