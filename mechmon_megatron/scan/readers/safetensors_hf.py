"""Hugging Face folders of ``*.safetensors`` weights (one folder per checkpoint).

Layout (``transformers`` ``save_pretrained`` / the Trainer's ``checkpoint-N`` folders)::

    RUN/checkpoint-500/config.json                       # num_attention_heads, num_key_value_heads
    RUN/checkpoint-500/model.safetensors                 # or model-0000i-of-0000n.safetensors

Q/K layouts by parameter name (``layouts.py``): ``q_proj`` / ``k_proj`` or a fused ``qkv_proj``
/ ``Wqkv`` / ``c_attn`` / ``query_key_value``, with QK-norms ``q_norm`` / ``k_norm`` (Qwen3,
Gemma 3: per head; OLMo-2: over the whole projection); multi-head latent attention with the
DeepSeek-V3 / Kimi K2 names (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``). ``safetensors.safe_open`` reads the
header (names, shapes, byte offsets) and then only the requested tensors' bytes: one layer at a
time. Head counts and dims come from ``config.json`` (``num_attention_heads`` / ``n_head``,
``num_key_value_heads``, ``head_dim``; for MLA ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``, ``q_lora_rank``, ``kv_lora_rank``; a multimodal model's ``text_config``), or from
the flags. Norms are RMSNorms (the Hugging Face models above use no LayerNorm QK-norm;
``--normalization LayerNorm`` says otherwise); Gemma's store ``gamma - 1`` (``model_type``).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.readers.base import HeadCounts, HeadHints, LayerShapes, LayerWeights
from mechmon_megatron.scan.readers.layouts import build_layer, find_layer_keys, resolve_heads

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


_ZERO_CENTRED_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")
"""Models whose RMSNorm multiplies by ``1 + weight`` (transformers' ``GemmaRMSNorm``): the stored
QK-norm weight is ``gamma - 1``."""


def _config_hints(folder: str) -> HeadHints:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return HeadHints()
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ScanInputError(f"{path}: not a JSON model config ({exc}).") from None
    if not isinstance(config, dict):
        raise ScanInputError(f"{path}: not a JSON model config (a {type(config).__name__}, expected an object).")
    text = config.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" not in config:
        config = {"model_type": config.get("model_type"), **text}  # a multimodal model's language tower
    model_type = str(config.get("model_type") or "")
    return HeadHints(
        num_heads=config.get("num_attention_heads", config.get("n_head")),
        num_groups=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"),
        qk_head_dim=config.get("qk_nope_head_dim"),
        qk_pos_emb_head_dim=config.get("qk_rope_head_dim"),
        v_head_dim=config.get("v_head_dim"),
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config.get("kv_lora_rank"),
        zero_centered_gamma=True if model_type in _ZERO_CENTRED_MODEL_TYPES else None,
        source=path,
    )


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
                "qkv_proj, Wqkv, c_attn or query_key_value weights, or MLA kv_a_proj_with_mqa / kv_b_proj)."
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
        return resolve_heads(keys, {k: self._shapes[k] for k in keys.keys}, self._hints, f"{self.path} layer {layer}")

    def _tensor(self, name: str) -> Any:
        try:
            return self._where[name].get_tensor(name)
        except Exception as exc:  # noqa: BLE001 -- truncated data section
            raise ScanInputError(f"{self.path}: cannot read tensor {name!r} ({type(exc).__name__}: {exc}).") from None

    def read_layer(self, layer: int) -> LayerWeights:
        counts = self.heads(layer)
        keys = self._keys[layer]
        tensors = {role: self._tensor(key) for role, key in zip(keys.roles, keys.keys)}
        return build_layer(keys, tensors, counts, self._tensor(keys.router) if keys.router else None,
                           f"{self.path} layer {layer}")
