"""DeepSpeed engine checkpoints (``engine.save_checkpoint``), read layer by layer.

Layout::

    SAVE/latest                                   # the tag of the last checkpoint
    SAVE/global_step50/mp_rank_00_model_states.pt  # {"module": state_dict, "global_steps": 50, ...}
    SAVE/global_step50/layer_0_expert_1_mp_rank_00_model_states.pt, *_optim_states.pt

``module`` holds every non-expert weight (ZeRO stages 0-2 and any data/expert-parallel size
save the whole module there; expert weights go to the per-expert files, which the scan does not
need: the MoE gate ``deepspeed_moe.gate.wg.weight`` stays in ``module``). The Q/K layouts are the
DeepSpeed adapter's (``layouts.py``). With model (tensor) parallelism, ``mp_rank_01`` ... hold
row shards of the fused or separate Q/K weights, concatenated in rank order (norm gammas are
replicated: rank 0's copy is read). QK-norms and MLA layers are recognised by name as in the other
readers (``layouts.py``); DeepSpeed saves no model config, so their head counts, dims and norm kind
come from the flags and the shapes. The file is memory-mapped, so only the layer being read is
touched.

Not readable here, with a message: ZeRO-3 checkpoints (``module`` holds empty placeholders; run
DeepSpeed's ``zero_to_fp32.py`` first) and pipeline-engine checkpoints (``layer_XX-model_states.pt``).
This reader imports neither deepspeed nor megatron: the files are plain ``torch.save`` output.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.readers.base import HeadCounts, HeadHints, LayerShapes, LayerWeights
from mechmon_megatron.scan.readers.layouts import (
    AttentionKeys,
    build_layer,
    find_layer_keys,
    replicated_roles,
    resolve_heads,
)
from mechmon_megatron.scan.readers.torch_files import load_mmap, tensor_at

__all__ = ["DeepSpeedReader", "is_deepspeed"]

_MP_FILE = re.compile(r"^mp_rank_(\d{2})_model_states\.pt$")
_EXPECTED = "a DeepSpeed model-states file (torch.save of {'module': state_dict, 'global_steps': ...})"


def _mp_files(path: str) -> dict[int, str]:
    out = {}
    for name in os.listdir(path):
        match = _MP_FILE.match(name)
        if match:
            out[int(match.group(1))] = os.path.join(path, name)
    return out


def is_deepspeed(path: str) -> bool:
    return os.path.isdir(path) and (bool(_mp_files(path)) or any(
        n.startswith("layer_") and n.endswith("-model_states.pt") for n in os.listdir(path)))


class DeepSpeedReader:
    """One ``global_stepN`` tag directory."""

    format = "deepspeed"

    def __init__(self, path: str, iteration: int, flag_hints: HeadHints) -> None:
        self.path, self.iteration = path, iteration
        files = _mp_files(path)
        if not files:
            raise ScanInputError(
                f"{path}: a DeepSpeed pipeline-engine checkpoint (layer_XX-model_states.pt) is not supported; "
                "expected mp_rank_00_model_states.pt (save the model with engine.save_checkpoint outside the "
                "pipeline engine, or convert it)."
            )
        if sorted(files) != list(range(len(files))):
            raise ScanInputError(f"{path}: model-parallel files {sorted(files)} are not 0..{len(files) - 1}.")
        self._files = [files[r] for r in range(len(files))]
        self._modules: list[Any] = []
        for file in self._files:
            state = load_mmap(file, _EXPECTED)
            module = state.get("module") if isinstance(state, dict) else None
            if not isinstance(module, dict):
                raise ScanInputError(f"{file}: no 'module' state dict; expected {_EXPECTED}.")
            self._modules.append(module)
        self._keys = find_layer_keys(self._modules[0], self._files[0])
        if not self._keys:
            raise ScanInputError(
                f"{self._files[0]}: no attention Q/K weights found (expected q_proj/k_proj, query_key_value, "
                "qkv_proj, c_attn or in_proj_weight parameters)."
            )
        for layer, keys in self._keys.items():
            if any(self._modules[0][k].numel() == 0 for k in keys.keys):
                raise ScanInputError(
                    f"{self._files[0]}: layer {layer}'s Q/K weights are empty placeholders (a ZeRO-3 checkpoint); "
                    "consolidate it first with DeepSpeed's zero_to_fp32.py."
                )
        self._hints = flag_hints

    def layers(self) -> list[int]:
        return sorted(self._keys)

    def _merged_shapes(self, keys: AttentionKeys) -> dict[str, tuple[int, ...]]:
        """Whole-layer shapes: row shards times the model-parallel size, replicated ones as stored."""
        local = {k: tuple(self._modules[0][k].shape) for k in keys.keys}
        whole = replicated_roles(keys, local)
        out = {}
        for role, key in zip(keys.roles, keys.keys):
            shape = list(local[key])
            if role not in whole:
                shape[0] *= len(self._modules)
            out[key] = tuple(shape)
        return out

    def shapes(self) -> dict[int, LayerShapes]:
        out = {}
        for L, keys in self._keys.items():
            merged = self._merged_shapes(keys)
            out[L] = LayerShapes(qk=tuple(merged[k] for k in keys.keys),
                                 router=tuple(self._modules[0][keys.router].shape) if keys.router else None)
        return out

    def heads(self, layer: int) -> HeadCounts:
        keys = self._keys[layer]
        return resolve_heads(keys, self._merged_shapes(keys), self._hints, f"{self.path} layer {layer}")

    def read_layer(self, layer: int) -> LayerWeights:
        counts = self.heads(layer)
        keys = self._keys[layer]
        whole = replicated_roles(keys, {k: tuple(self._modules[0][k].shape) for k in keys.keys})
        tensors = {}
        for role, key in zip(keys.roles, keys.keys):
            pairs = list(zip(self._modules, self._files))[: 1 if role in whole else None]
            tensors[role] = torch.cat([tensor_at(m, key, f) for m, f in pairs], dim=0)
        router = tensor_at(self._modules[0], keys.router, self._files[0]) if keys.router else None
        return build_layer(keys, tensors, counts, router, f"{self.path} layer {layer}")
