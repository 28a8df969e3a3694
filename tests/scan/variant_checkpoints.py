"""Checkpoint series of single attention layers (MLA, QK-norm) in the scan's formats, and what the
live session computes on the same weights.

The weights are those of megatron-core's own modules (``tests/megatron_core/test_mla_layout.py``
``_mla_module``, ``tests/megatron_core/test_qk_norm_and_mla_sites.py`` ``_qk_norm_attention``)
before and after one Adam step; each state is saved as a real checkpoint of one format:

* Megatron-LM legacy: ``iter_XXXXXXX/mp_rank_TT/model_optim_rng.pt`` holding
  ``{"model": {"decoder.layers.0.self_attention.<name>": tensor}, "args": Namespace}``, as
  Megatron-LM's ``save_checkpoint`` writes it with ``--ckpt-format torch`` (TP shards per rank);
* ``torch_dist``: a ``torch.distributed.checkpoint`` store of the tensors stacked on a leading
  layer axis (``decoder.layers.self_attention.<name>`` ``[1, ...]``), as megatron-core's
  ``dist_checkpointing`` writes them (no ``common.pt`` args: the example trainer writes none);
* Hugging Face: ``checkpoint-N/model.safetensors`` with the DeepSeek-V3 / Qwen3 / OLMo-2 names
  and ``config.json``;
* DeepSpeed: ``global_stepN/mp_rank_00_model_states.pt`` with the Hugging Face names (no config).

The live reference runs the megatron-core adapter's site on the module (``attention_sites``),
snapshots it as the session does, and calls the session's checks with the session's defaults.
"""

from __future__ import annotations

import json
import os
import warnings
from argparse import Namespace
from pathlib import Path
from typing import Callable, Mapping

import torch

State = dict[str, torch.Tensor]
LEGACY_PREFIX = "decoder.layers.0.self_attention."
DIST_PREFIX = "decoder.layers.self_attention."
TRACKER = "latest_checkpointed_iteration.txt"

# megatron-core module names -> Hugging Face DeepSeek-V3 names (model.layers.0.self_attn.<name>).
MLA_HF_NAMES = {
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_q_proj.weight": "q_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
}


def module_state(module: torch.nn.Module) -> State:
    """The module's tensors (``_extra_state`` entries left out), detached copies."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def write_legacy(root: Path, states: Mapping[int, State], args: Namespace | None, tp: int = 1,
                 shard: Callable[[str, torch.Tensor, int, int], torch.Tensor] | None = None) -> Path:
    """``root`` as a Megatron-LM run folder of legacy checkpoints; ``shard(name, tensor, rank,
    tp)`` gives rank ``rank``'s copy of a tensor (default: the whole tensor)."""
    for iteration, state in states.items():
        for rank in range(tp):
            model = {LEGACY_PREFIX + k: (shard(k, v, rank, tp) if shard else v).clone() for k, v in state.items()}
            folder = root / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}"
            folder.mkdir(parents=True)
            payload = {"model": model, "iteration": iteration, "checkpoint_version": 3.0}
            if args is not None:
                payload["args"] = args
            torch.save(payload, folder / "model_optim_rng.pt")
    (root / TRACKER).write_text(str(max(states)))
    return root


def write_torch_dist(root: Path, states: Mapping[int, State]) -> Path:
    """``root`` as a run folder of ``torch_dist`` checkpoints, tensors stacked over one layer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    for iteration, state in states.items():
        stacked = {DIST_PREFIX + k: v[None].clone() for k, v in state.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # one process: intended
            dcp.save(stacked, storage_writer=FileSystemWriter(str(root / f"iter_{iteration:07d}")), no_dist=True)
    (root / TRACKER).write_text(str(max(states)))
    return root


def write_hf(root: Path, states: Mapping[int, State], config: dict, names: Mapping[str, str]) -> Path:
    """``root`` as a run folder of Hugging Face ``checkpoint-N`` safetensors folders; ``names``
    maps a state's names to the ``model.layers.0.self_attn.<name>`` ones (others are left out)."""
    from safetensors.torch import save_file

    for iteration, state in states.items():
        folder = root / f"checkpoint-{iteration}"
        folder.mkdir(parents=True)
        tensors = {f"model.layers.0.self_attn.{names[k]}": v.contiguous() for k, v in state.items() if k in names}
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
    return root


def write_deepspeed(root: Path, states: Mapping[int, State], names: Mapping[str, str]) -> Path:
    """``root`` as a DeepSpeed save folder (``global_stepN/mp_rank_00_model_states.pt`` holding
    ``{"module": state_dict, "global_steps": N}``, and ``latest``), with the Hugging Face names
    ``model.layers.0.self_attn.<name>`` a DeepSpeed-trained Hugging Face model has."""
    for iteration, state in states.items():
        folder = root / f"global_step{iteration}"
        folder.mkdir(parents=True)
        module = {f"model.layers.0.self_attn.{names[k]}": v.clone() for k, v in state.items() if k in names}
        torch.save({"module": module, "global_steps": iteration}, folder / "mp_rank_00_model_states.pt")
    (root / "latest").write_text(f"global_step{max(states)}")
    return root


def rope_permuted(state: State, num_heads: int, d_nope: int, d_rope: int, kv_lora_rank: int) -> State:
    """The MLA state with the RoPE channels of every query head and of the shared RoPE key
    permuted alike (as Hugging Face's DeepSeek conversion does: interleaved pairs to halves)."""
    perm = torch.cat([torch.arange(0, d_rope, 2), torch.arange(1, d_rope, 2)])
    out = dict(state)
    q_name = "linear_q_up_proj.weight" if "linear_q_up_proj.weight" in state else "linear_q_proj.weight"
    q = state[q_name].reshape(num_heads, d_nope + d_rope, -1)
    out[q_name] = torch.cat([q[:, :d_nope], q[:, d_nope:][:, perm]], dim=1).reshape(state[q_name].shape)
    kv = state["linear_kv_down_proj.weight"]
    out["linear_kv_down_proj.weight"] = torch.cat([kv[:kv_lora_rank], kv[kv_lora_rank:][perm]])
    return out


def live_scalars(site, step: Callable[[], None], alpha: float) -> tuple[dict[str, float], tuple, tuple]:
    """The live session's final scalars for one layer across ``step()`` (an optimizer step), with
    the session's defaults; also the (heads, full) reads before and after."""
    from mechmon_megatron.session.attention_check import check_full, check_heads
    from mechmon_megatron.session.config import MechmonConfig
    from mechmon_megatron.session.host import MLAHeads
    from mechmon_megatron.session.mla_check import check_mla_heads
    from mechmon_megatron.session.records import merge_partials
    from mechmon_megatron.session.snapshots import SnapshotStore

    cfg = MechmonConfig(enabled=True, alpha=alpha, per_head_scalars=True)
    full = site.read_full()
    prev = SnapshotStore("cpu").take(site.read_heads(), full)
    step()
    full = site.read_full()
    now = (site.read_heads(), full)
    layer = site.layer_number
    if isinstance(now[0], MLAHeads):
        heads = check_mla_heads(layer, prev[0], now[0], cfg.alpha, cfg.per_head_scalars)
    else:
        heads = check_heads(layer, prev[0], now[0], cfg.alpha, cfg.qk_method, cfg.per_head_scalars)
    whole = check_full(layer, prev[1], now[1], cfg.alpha, cfg.full_matrix_method, cfg.full_matrix_rank,
                       cfg.wq_norm_power_iters)
    return merge_partials([heads.scalars, whole.scalars]), prev, now


def scan_values(out: Path, later: int) -> dict[str, float]:
    """The scalars a scan computed for the pair ending at ``later`` (from its cache, full precision)."""
    values: dict[str, float] = {}
    for name in sorted(os.listdir(out / "cache")):
        for line in (out / "cache" / name).read_text().splitlines()[1:]:
            record = json.loads(line)
            if record["later"] == later:
                values.update(record["scalars"])
    return values


def adam_step(module: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """One Adam step (lr 1e-2) on ``loss()``, as a callable."""

    def step() -> None:
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
        loss().backward()
        optimizer.step()

    return step
