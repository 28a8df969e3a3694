"""Hugging Face folders of ``*.safetensors`` weights (one folder per checkpoint).

Layout (``transformers`` ``save_pretrained`` / the Trainer's ``checkpoint-N`` folders)::

    RUN/checkpoint-500/config.json                       # num_attention_heads, num_key_value_heads
    RUN/checkpoint-500/model.safetensors                 # or model-0000i-of-0000n.safetensors

Q/K layouts by parameter name (``layouts.py``): ``q_proj`` / ``k_proj`` or a fused ``qkv_proj``
/ ``Wqkv`` / ``c_attn`` / ``query_key_value``. ``safetensors.safe_open`` reads the header (names,
shapes, byte offsets) and then only the requested tensors' bytes: one layer at a time.
Head counts come from ``config.json`` (``num_attention_heads`` / ``n_head``,
``num_key_value_heads``, ``head_dim``), or from the flags.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.readers.base import HeadCounts, HeadHints, LayerShapes, LayerWeights
from mechmon_megatron.scan.readers.layouts import find_layer_keys, resolve_heads, split_heads

__all__ = ["SafetensorsReader", "is_safetensors_folder"]


def is_safetensors_folder(path: str) -> bool:
    return os.path.isdir(path) and bool(glob.glob(os.path.join(path, "*.safetensors")))


def _safe_open(path: str) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ScanInputError(
            f"{path}: reading safetensors needs the `safetensors` package: pip install 'mechmon-megatron[scan]'"
        ) from exc
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 -- truncated header, not a safetensors file
        raise ScanInputError(
            f"{path}: cannot read it ({type(exc).__name__}: {exc}); expected a safetensors file."
        ) from None


def _config_hints(folder: str) -> HeadHints:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return HeadHints()
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ScanInputError(f"{path}: not a JSON model config ({exc}).") from None
    heads = config.get("num_attention_heads", config.get("n_head"))
    groups = config.get("num_key_value_heads")
    head_dim = config.get("head_dim")
    return HeadHints(num_heads=heads, num_groups=groups, head_dim=head_dim, source=path)


class SafetensorsReader:
    """One folder of safetensors shards."""

    format = "hf_safetensors"

    def __init__(self, path: str, iteration: int, flag_hints: HeadHints) -> None:
        self.path, self.iteration = path, iteration
        self._files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        self._where: dict[str, Any] = {}  # tensor name -> open file handle
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in self._files:
            handle = _safe_open(file)
            for name in handle.keys():
                self._where[name] = handle
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())
        self._keys = find_layer_keys(self._shapes, path)
        if not self._keys:
            raise ScanInputError(
                f"{path}: no attention Q/K weights in {len(self._files)} safetensors file(s) (expected q_proj/k_proj, "
                "qkv_proj, Wqkv, c_attn or query_key_value weights)."
            )
        self._hints = _config_hints(path).override(flag_hints)

    def layers(self) -> list[int]:
        return sorted(self._keys)

    def shapes(self) -> dict[int, LayerShapes]:
        return {
            L: LayerShapes(qk=tuple(self._shapes[k] for k in keys.keys),
                           router=self._shapes[keys.router] if keys.router else None)
            for L, keys in self._keys.items()
        }

    def heads(self, layer: int) -> HeadCounts:
        keys = self._keys[layer]
        return resolve_heads(keys.layout, {k: self._shapes[k] for k in keys.keys}, self._hints,
                             f"{self.path} layer {layer}")

    def _tensor(self, name: str) -> Any:
        try:
            return self._where[name].get_tensor(name)
        except Exception as exc:  # noqa: BLE001 -- truncated data section
            raise ScanInputError(f"{self.path}: cannot read tensor {name!r} ({type(exc).__name__}: {exc}).") from None

    def read_layer(self, layer: int) -> LayerWeights:
        counts = self.heads(layer)
        keys = self._keys[layer]
        wq, wk = split_heads(keys.layout, [self._tensor(k) for k in keys.keys], counts)
        router = self._tensor(keys.router) if keys.router else None
        return LayerWeights(layer=layer, wq=wq, wk=wk, router=router)
