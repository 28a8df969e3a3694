"""Megatron ``torch_dist`` checkpoints (megatron-core ``dist_checkpointing``), read layer by layer.

Layout (``examples/pretrain_scripts/gpt_trainer/checkpoint.py``, Megatron-LM alike)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000050/{metadata.json, .metadata, common.pt, __R_S.distcp ...}

The files are a ``torch.distributed.checkpoint`` (DCP) store of GLOBAL tensors: every rank wrote
its shard as a chunk at its offsets, so the stored tensors do not depend on the saving run's TP /
PP / EP layout. megatron-core stacks the transformer layers on a leading axis:
``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, rows, hidden]`` (global
layer index, whatever the pipeline split) and ``decoder.layers.mlp.router.weight`` is
``[num_layers, num_experts, hidden]``.

Partial loading: the DCP metadata (``.metadata``) lists every chunk and where its bytes are. A
load planner (:class:`_SlicePlanner`) requests only the chunk ``[layer, :, :]`` of each needed
tensor, and DCP's ``FileSystemReader`` reads only the byte ranges of the stored chunks that
overlap it. The whole model (and the optimizer state beside it) is never read. Only torch is
needed: no megatron import, no process group (``no_dist=True``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.readers.base import HeadCounts, HeadHints, LayerShapes, LayerWeights
from mechmon_megatron.scan.readers.layouts import find_layer_keys, resolve_heads, split_heads

__all__ = ["TorchDistReader", "is_torch_dist"]

QKV_KEY = "decoder.layers.self_attention.linear_qkv.weight"
ROUTER_KEY = "decoder.layers.mlp.router.weight"


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
    """One ``iter_XXXXXXX`` directory of a ``torch_dist`` checkpoint."""

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
        self._qkv = self._find(QKV_KEY)
        self._router = self._find(ROUTER_KEY)
        self._per_layer = None if self._qkv else find_layer_keys(self._tensors, path)
        if not self._qkv and not self._per_layer:
            raise ScanInputError(
                f"{path}: no attention Q/K tensor in the torch_dist metadata (expected {QKV_KEY!r} of shape "
                "[num_layers, rows, hidden], or per-layer q_proj/k_proj / linear_qkv weights)."
            )
        self._hints = self._common_hints().override(flag_hints)

    def _find(self, key: str) -> Optional[str]:
        if key in self._tensors:
            return key
        tail = key.split(".", 1)[1]
        found = sorted(k for k in self._tensors if k.endswith(tail) and not k.startswith("optimizer"))
        return found[0] if found else None

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
        if self._qkv:
            return list(range(1, int(self._tensors[self._qkv].size[0]) + 1))
        assert self._per_layer is not None
        return sorted(self._per_layer)

    def shapes(self) -> dict[int, LayerShapes]:
        if self._qkv:
            qkv = tuple(int(x) for x in self._tensors[self._qkv].size[1:])
            router = tuple(int(x) for x in self._tensors[self._router].size[1:]) if self._router else None
            return {L: LayerShapes(qk=(qkv,), router=router) for L in self.layers()}
        assert self._per_layer is not None
        out = {}
        for L, keys in self._per_layer.items():
            router = tuple(int(x) for x in self._tensors[keys.router].size) if keys.router else None
            out[L] = LayerShapes(qk=tuple(tuple(int(x) for x in self._tensors[k].size) for k in keys.keys),
                                 router=router)
        return out

    def heads(self, layer: int) -> HeadCounts:
        shapes = self.shapes()[layer]
        layout = "megatron_qkv" if self._qkv else self._per_layer[layer].layout  # type: ignore[index]
        return resolve_heads(layout, {str(i): s for i, s in enumerate(shapes.qk)}, self._hints,
                             f"{self.path} layer {layer}")

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

    def _stacked_request(self, key: str, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        size = tuple(int(x) for x in self._tensors[key].size)
        return (layer - 1,) + (0,) * (len(size) - 1), (1,) + size[1:]

    def read_layer(self, layer: int) -> LayerWeights:
        counts = self.heads(layer)
        if self._qkv:
            requests = {self._qkv: self._stacked_request(self._qkv, layer)}
            if self._router:
                requests[self._router] = self._stacked_request(self._router, layer)
            got = self._load(requests)
            wq, wk = split_heads("megatron_qkv", [got[self._qkv][0]], counts)
            router = got[self._router][0] if self._router else None
            return LayerWeights(layer=layer, wq=wq, wk=wk, router=router)
        assert self._per_layer is not None
        keys = self._per_layer[layer]
        wanted = list(keys.keys) + ([keys.router] if keys.router else [])
        got = self._load({k: ((0,) * len(self._tensors[k].size), tuple(int(x) for x in self._tensors[k].size))
                          for k in wanted})
        wq, wk = split_heads(keys.layout, [got[k] for k in keys.keys], counts)
        return LayerWeights(layer=layer, wq=wq, wk=wk, router=got[keys.router] if keys.router else None)


def _short(exc: BaseException) -> str:
    """One line: DCP's CheckpointException carries the worker's whole traceback; its last line is the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def hints_from_megatron_args(args: Any, source: str) -> HeadHints:
    """Head counts from a Megatron-LM ``args`` namespace (None: nothing known)."""
    if args is None:
        return HeadHints()
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    return HeadHints(num_heads=heads, num_groups=groups, head_dim=getattr(args, "kv_channels", None), source=source)
