"""Megatron-LM legacy ``torch`` checkpoints: one ``model_optim_rng.pt`` per model-parallel rank.

Layout::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000050/mp_rank_TT/model_optim_rng.pt            # PP = 1
    SAVE/iter_0000050/mp_rank_TT_PPP/model_optim_rng.pt        # PP > 1
    SAVE/iter_0000050/mp_rank_TT_PPP_EEE/model_optim_rng.pt    # with expert parallelism

Each file holds ``{"model": state_dict, "optimizer": ..., "args": Namespace, ...}`` of ONE rank:
tensor-parallel shards of the weights, and only the layers of its pipeline stage, numbered
locally (``decoder.layers.0...`` on every stage). The global layer number is the local index +
1 + the number of layers of the earlier stages (counted from their files, so uneven splits are
right). A layer's fused ``linear_qkv`` rows are split contiguously over the TP ranks (whole query
groups each), so the layer's weight is the concatenation of the TP shards in rank order; so are
an MLA layer's up projections (and ``linear_q_proj``), split by head. Norm gammas (QK-norm, MLA
latent norms) and the router weight are replicated over TP and EP ranks (rank 0's copy is read);
an MLA down projection is replicated under Transformer Engine and a row shard under the local
spec, told apart by its row count (``layouts.replicated_roles``). Expert-parallel ranks hold the
same attention weights; EP rank 0 is read. Head counts, MLA dims and the norm kind come from the
stored ``args``.

Files are memory-mapped (``torch_files.load_mmap``): reading one layer touches only that layer's
shards, never the rest of the model or the optimizer state. Virtual pipeline stages (``model0``,
``model1`` ...) are refused with a message.
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
from mechmon_megatron.scan.readers.torch_dist import hints_from_megatron_args
from mechmon_megatron.scan.readers.torch_files import load_mmap, tensor_at

__all__ = ["MegatronLegacyReader", "is_megatron_legacy"]

FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_EXPECTED = "a Megatron-LM legacy checkpoint file (torch.save of {'model': ..., 'args': ...})"


def _rank_dirs(path: str) -> dict[tuple[int, int], str]:
    """(tp, pp) -> file, EP rank 0 only."""
    out: dict[tuple[int, int], str] = {}
    for name in sorted(os.listdir(path)):
        match = _RANK_DIR.match(name)
        if match and os.path.isfile(os.path.join(path, name, FILE)):
            tp, pp, ep = int(match.group(1)), int(match.group(2) or 0), int(match.group(3) or 0)
            if ep == 0:
                out[(tp, pp)] = os.path.join(path, name, FILE)
    return out


def is_megatron_legacy(path: str) -> bool:
    return os.path.isdir(path) and bool(_rank_dirs(path))


class MegatronLegacyReader:
    """One ``iter_XXXXXXX`` directory of the legacy format, any TP / PP / EP layout."""

    format = "megatron_legacy_torch"

    def __init__(self, path: str, iteration: int, flag_hints: HeadHints) -> None:
        self.path, self.iteration = path, iteration
        files = _rank_dirs(path)
        self.tp = 1 + max(t for t, _ in files)
        self.pp = 1 + max(p for _, p in files)
        missing = [(t, p) for t in range(self.tp) for p in range(self.pp) if (t, p) not in files]
        if missing:
            raise ScanInputError(
                f"{path}: model-parallel rank files missing for (tp, pp) = {missing}; expected "
                f"mp_rank_TT[_PPP]/{FILE} for all {self.tp} x {self.pp} ranks."
            )
        self._files = files
        self._states: dict[tuple[int, int], Any] = {}
        self._keys: dict[int, tuple[int, AttentionKeys]] = {}  # global layer -> (stage, keys)
        offset = 0
        hints = HeadHints()
        for stage in range(self.pp):
            state = self._state(0, stage)
            if "model" not in state:
                extra = " (virtual pipeline stages model0, model1, ... are not supported)" if "model0" in state else ""
                raise ScanInputError(f"{files[(0, stage)]}: no 'model' state dict{extra}; expected {_EXPECTED}.")
            found = find_layer_keys(state["model"], files[(0, stage)], layer_offset=offset)
            for layer, keys in found.items():
                self._keys[layer] = (stage, keys)
            offset += len(found)
            if stage == 0:
                hints = hints_from_megatron_args(state.get("args"), f"args in {files[(0, 0)]}")
        if not self._keys:
            raise ScanInputError(f"{path}: no attention Q/K weights (linear_qkv, q_proj/k_proj, or the MLA "
                                 "projections linear_kv_down_proj / linear_kv_up_proj ...) in the model state.")
        self._hints = hints.override(flag_hints)

    def _state(self, tp: int, pp: int) -> Any:
        if (tp, pp) not in self._states:
            state = load_mmap(self._files[(tp, pp)], _EXPECTED)
            if not isinstance(state, dict):
                raise ScanInputError(f"{self._files[(tp, pp)]}: expected {_EXPECTED}, got {type(state).__name__}.")
            self._states[(tp, pp)] = state
        return self._states[(tp, pp)]

    def layers(self) -> list[int]:
        return sorted(self._keys)

    def _local(self, stage: int, keys: AttentionKeys) -> dict[str, tuple[int, ...]]:
        model = self._state(0, stage)["model"]
        return {k: tuple(model[k].shape) for k in keys.keys}

    def _merged_shapes(self, stage: int, keys: AttentionKeys) -> dict[str, tuple[int, ...]]:
        """Shapes of the whole layer's tensors: row shards times TP, replicated ones as stored."""
        local = self._local(stage, keys)
        whole = replicated_roles(keys, local)
        out = {}
        for role, key in zip(keys.roles, keys.keys):
            shape = list(local[key])
            if role not in whole:
                shape[0] *= self.tp
            out[key] = tuple(shape)
        return out

    def shapes(self) -> dict[int, LayerShapes]:
        out = {}
        for layer, (stage, keys) in self._keys.items():
            router = tuple(self._state(0, stage)["model"][keys.router].shape) if keys.router else None
            merged = self._merged_shapes(stage, keys)
            out[layer] = LayerShapes(qk=tuple(merged[k] for k in keys.keys), router=router)
        return out

    def heads(self, layer: int) -> HeadCounts:
        stage, keys = self._keys[layer]
        return resolve_heads(keys, self._merged_shapes(stage, keys), self._hints, f"{self.path} layer {layer}")

    def read_layer(self, layer: int) -> LayerWeights:
        counts = self.heads(layer)
        stage, keys = self._keys[layer]
        whole = replicated_roles(keys, self._local(stage, keys))
        tensors = {}
        for role, key in zip(keys.roles, keys.keys):
            ranks = [0] if role in whole else range(self.tp)
            shards = [tensor_at(self._state(t, stage)["model"], key, self._files[(t, stage)]) for t in ranks]
            tensors[role] = torch.cat(shards, dim=0) if len(shards) > 1 else shards[0]
        router = None
        if keys.router:
            router = tensor_at(self._state(0, stage)["model"], keys.router, self._files[(0, stage)])
        return build_layer(keys, tensors, counts, router, f"{self.path} layer {layer}")
