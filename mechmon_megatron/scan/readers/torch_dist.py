"""Megatron ``torch_dist`` checkpoints (megatron-core ``dist_checkpointing``), read layer by layer.

Layout (``examples/pretrain_scripts/gpt_trainer/checkpoint.py``, Megatron-LM alike)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000050/{metadata.json, .metadata, common.pt, __R_S.distcp ...}

The files are a ``torch.distributed.checkpoint`` (DCP) store of GLOBAL tensors: every rank wrote
its shard as a chunk at its offsets, so the stored tensors do not depend on the saving run's TP /
PP / EP layout. megatron-core stacks the transformer layers on a leading axis:
``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, rows, hidden]`` (global
layer index, whatever the pipeline split), ``decoder.layers.mlp.router.weight`` is
``[num_layers, num_experts, hidden]``, and so are the QK-norm gammas
(``decoder.layers.self_attention.q_layernorm.weight`` ``[num_layers, head_dim]``) and the
projections and latent norms of multi-head latent attention
(``decoder.layers.self_attention.linear_kv_down_proj.weight`` ``[num_layers, kv_lora_rank +
qk_pos_emb_head_dim, hidden]``, ...; ``layouts.py``). Head counts and MLA dims come from the
``args`` Megatron-LM writes into ``common.pt``, else from the flags and the shapes.

Partial loading: the DCP metadata (``.metadata``) lists every chunk and where its bytes are. A
load planner (:class:`_SlicePlanner`) requests only the chunk ``[layer, :, :]`` of each needed
tensor, and DCP's ``FileSystemReader`` reads only the byte ranges of the stored chunks that
overlap it. The whole model (and the optimizer state beside it) is never read. Only torch is
needed: no megatron import, no process group (``no_dist=True``).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Optional

import torch

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.readers.base import HeadCounts, HeadHints, LayerShapes, LayerWeights
from mechmon_megatron.scan.readers.layouts import build_layer, find_layer_keys, resolve_heads

__all__ = ["TorchDistReader", "is_torch_dist"]

QKV_KEY = "decoder.layers.self_attention.linear_qkv.weight"


def is_torch_dist(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) and any(
        name.endswith(".distcp") for name in os.listdir(path)
    )


def _planner(requests: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class _SlicePlanner(DefaultLoadPlanner):
        """Loads the chunk ``requests[fqn] = (offsets, sizes)`` of each tensor into ``state_dict[fqn]``."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> LoadPlan:
            assert self.metadata is not None  # set_up_planner ran
            items = []
            for fqn, (offsets, sizes) in requests.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                md = self.metadata.state_dict_metadata[fqn]
                assert isinstance(md, TensorStorageMetadata)
                items += create_read_items_for_chunk_list(fqn, md, [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            # The destination is a plain tensor holding exactly the requested chunk; DCP narrows
            # it with the read item's offsets relative to that chunk.
            return self.state_dict[index.fqn]

    return _SlicePlanner()


class TorchDistReader:
    """One ``iter_XXXXXXX`` directory of a ``torch_dist`` checkpoint.

    Every stored tensor stacked over the layers (``...decoder.layers.<name>``, leading axis the
    global layer) is seen as one tensor per layer, ``...decoder.layers.<i>.<name>`` (the layers
    whose chunk the store holds), so the per-layer layouts of ``layouts.py`` (classic Q/K with
    QK-norms, MLA, routers) apply as to a flat state dict.
    """

    format = "megatron_torch_dist"

    def __init__(self, path: str, iteration: int, flag_hints: HeadHints) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path, self.iteration = path, iteration
        try:
            self._metadata = FileSystemReader(path).read_metadata()
        except Exception as exc:  # noqa: BLE001 -- any failure here is an unreadable checkpoint
            raise ScanInputError(
                f"{os.path.join(path, '.metadata')}: cannot read the torch_dist metadata ({_short(exc)}); "
                "expected a checkpoint written by megatron-core dist_checkpointing."
            ) from None
        self._tensors: dict[str, Any] = {  # TensorStorageMetadata (size, properties.dtype, chunks) by key
            k: v for k, v in self._metadata.state_dict_metadata.items() if hasattr(v, "chunks")
        }
        # Per-layer name -> (stored key, layer index or None). The decoder's stacked tensors when
        # there are any (other modules numbered from 0, e.g. multi-token prediction layers, would
        # collide with the decoder's layer numbers), else the tensors as stored.
        stacked = _per_layer_view(self._tensors)
        self._where = stacked or {key: (key, None) for key in self._tensors}
        self._keys = find_layer_keys(self._where, path)
        if not self._keys:
            raise ScanInputError(
                f"{path}: no attention Q/K tensor in the torch_dist metadata (expected {QKV_KEY!r} of shape "
                "[num_layers, rows, hidden], the MLA projections (decoder.layers.self_attention.linear_kv_down_proj"
                ".weight, ...), or per-layer q_proj/k_proj / linear_qkv weights)."
            )
        self._hints = self._common_hints().override(flag_hints)

    def _common_hints(self) -> HeadHints:
        """Megatron-LM writes its ``args`` into ``common.pt``; the example trainer does not."""
        common = os.path.join(self.path, "common.pt")
        if not os.path.isfile(common):
            return HeadHints()
        try:
            state = torch.load(common, map_location="cpu", weights_only=False, mmap=True)
        except Exception:  # noqa: BLE001 -- no hints is fine; the heads may come from flags
            return HeadHints()
        return hints_from_megatron_args(state.get("args") if isinstance(state, dict) else None, "args in common.pt")

    def layers(self) -> list[int]:
        return sorted(self._keys)

    def _shape(self, name: str) -> tuple[int, ...]:
        key, index = self._where[name]
        size = tuple(int(x) for x in self._tensors[key].size)
        return size if index is None else size[1:]

    def shapes(self) -> dict[int, LayerShapes]:
        return {L: LayerShapes(qk=tuple(self._shape(k) for k in keys.keys),
                               router=self._shape(keys.router) if keys.router else None)
                for L, keys in self._keys.items()}

    def heads(self, layer: int) -> HeadCounts:
        keys = self._keys[layer]
        return resolve_heads(keys, {k: self._shape(k) for k in keys.keys}, self._hints, f"{self.path} layer {layer}")

    def _load(self, requests: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.api import CheckpointException

        dest = {fqn: torch.empty(sizes, dtype=self._tensors[fqn].properties.dtype) for fqn, (_, sizes) in
                requests.items()}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(dest, storage_reader=FileSystemReader(self.path), planner=_planner(requests), no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 -- a truncated or corrupt shard file
            # DCP wraps a worker's failure in CheckpointException, a BaseException (not an Exception).
            raise ScanInputError(
                f"{self.path}: cannot read {sorted(requests)} ({_short(exc)}); the checkpoint's .distcp files are "
                "incomplete or corrupt."
            ) from None
        return dest

    def _request(self, name: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """(stored key, offsets, sizes) of one per-layer tensor: its layer's chunk of a stacked
        tensor, or the whole tensor."""
        key, index = self._where[name]
        size = tuple(int(x) for x in self._tensors[key].size)
        if index is None:
            return key, (0,) * len(size), size
        return key, (index,) + (0,) * (len(size) - 1), (1,) + size[1:]

    def read_layer(self, layer: int) -> LayerWeights:
        counts = self.heads(layer)
        keys = self._keys[layer]
        names = list(keys.keys) + ([keys.router] if keys.router else [])
        requests = {name: self._request(name) for name in names}
        # One stored tensor is requested once (two names never share one: one layer, one chunk each).
        got = self._load({key: (offsets, sizes) for key, offsets, sizes in requests.values()})

        def tensor(name: str) -> torch.Tensor:
            key, index = self._where[name]
            return got[key][0] if index is not None else got[key]

        tensors = {role: tensor(name) for role, name in zip(keys.roles, keys.keys)}
        return build_layer(keys, tensors, counts, tensor(keys.router) if keys.router else None,
                           f"{self.path} layer {layer}")


_STACKED = re.compile(r"(?:^|\.)decoder\.layers\.(?=[^\d.])")


def _covered(meta: Any) -> set[int]:
    """Indices along the leading (layer) axis that the stored chunks cover."""
    out: set[int] = set()
    for chunk in meta.chunks:
        start = int(chunk.offsets[0])
        out.update(range(start, start + int(chunk.sizes[0])))
    return out


def _per_layer_view(tensors: dict[str, Any]) -> dict[str, tuple[str, Optional[int]]]:
    """The decoder's stacked tensors seen per layer: ``...decoder.layers.<i>.<name>`` ->
    (stored key ``...decoder.layers.<name>``, index ``i`` on its leading axis).

    megatron-core stacks each transformer-layer tensor on a leading layer axis
    (``decoder.layers.self_attention.linear_qkv.weight`` ``[num_layers, rows, hidden]``); a tensor
    only some layers have (an MoE router with dense layers between) is stored as chunks at those
    layers only, and only those are listed.
    """
    out: dict[str, tuple[str, Optional[int]]] = {}
    for key, meta in tensors.items():
        match = _STACKED.search(key)
        if key.startswith("optimizer") or match is None or len(meta.size) < 2:
            continue
        for index in sorted(_covered(meta)):
            out[f"{key[:match.end()]}{index}.{key[match.end():]}"] = (key, index)
    return out


def _short(exc: BaseException) -> str:
    """One line: DCP's CheckpointException carries the worker's whole traceback; its last line is the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def hints_from_megatron_args(args: Any, source: str) -> HeadHints:
    """Head layout from a Megatron-LM ``args`` namespace (None: nothing known).

    The MLA dims are taken only with ``multi_latent_attention``: Megatron-LM's ``args`` carry
    their defaults (``qk_head_dim`` 128, ...) for every model. ``normalization`` (Megatron-LM's
    default is LayerNorm) and ``apply_layernorm_1p`` (megatron-core's
    ``layernorm_zero_centered_gamma``) say how the QK-norms and latent norms fold.
    """
    if args is None:
        return HeadHints()

    def get(name: str) -> Any:
        return getattr(args, name, None)

    groups = get("num_query_groups") if get("group_query_attention") else None
    mla = bool(get("multi_latent_attention"))
    zero = get("apply_layernorm_1p")
    if zero is None:
        zero = get("layernorm_zero_centered_gamma")
    normalization = get("normalization") if get("normalization") in ("LayerNorm", "RMSNorm") else None
    return HeadHints(
        num_heads=get("num_attention_heads"), num_groups=groups, head_dim=get("kv_channels"),
        qk_head_dim=get("qk_head_dim") if mla else None,
        qk_pos_emb_head_dim=get("qk_pos_emb_head_dim") if mla else None,
        v_head_dim=get("v_head_dim") if mla else None,
        q_lora_rank=get("q_lora_rank") if mla else None, kv_lora_rank=get("kv_lora_rank") if mla else None,
        normalization=normalization, zero_centered_gamma=None if zero is None else bool(zero), source=source)
