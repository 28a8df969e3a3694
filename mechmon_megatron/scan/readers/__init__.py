"""Checkpoint readers, one file per format; :func:`open_reader` picks one for a checkpoint."""

from __future__ import annotations

from typing import Callable

from mechmon_megatron.scan.readers.base import CheckpointReader, HeadCounts, HeadHints, LayerShapes, LayerWeights
from mechmon_megatron.scan.readers.deepspeed_ckpt import DeepSpeedReader, is_deepspeed
from mechmon_megatron.scan.readers.megatron_legacy import MegatronLegacyReader, is_megatron_legacy
from mechmon_megatron.scan.readers.safetensors_hf import SafetensorsReader, is_safetensors_folder
from mechmon_megatron.scan.readers.torch_dist import TorchDistReader, is_torch_dist

__all__ = [
    "CheckpointReader",
    "HeadCounts",
    "HeadHints",
    "LayerShapes",
    "LayerWeights",
    "detect_format",
    "open_reader",
]

_READERS: dict[str, Callable[[str, int, HeadHints], CheckpointReader]] = {
    TorchDistReader.format: TorchDistReader,
    MegatronLegacyReader.format: MegatronLegacyReader,
    DeepSpeedReader.format: DeepSpeedReader,
    SafetensorsReader.format: SafetensorsReader,
}


def detect_format(path: str) -> str | None:
    """The format of one checkpoint directory, or None if it is none of the known ones."""
    if is_torch_dist(path):
        return TorchDistReader.format
    if is_megatron_legacy(path):
        return MegatronLegacyReader.format
    if is_deepspeed(path):
        return DeepSpeedReader.format
    if is_safetensors_folder(path):
        return SafetensorsReader.format
    return None


def open_reader(fmt: str, path: str, iteration: int, hints: HeadHints) -> CheckpointReader:
    return _READERS[fmt](path, iteration, hints)
