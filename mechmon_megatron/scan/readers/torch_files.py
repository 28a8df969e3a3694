"""Loading ``torch.save`` files lazily: memory-mapped, so only the tensors touched are read."""

from __future__ import annotations

import logging
from typing import Any

import torch

from mechmon_megatron.scan.errors import ScanInputError

logger = logging.getLogger(__name__)


def load_mmap(path: str, expected: str) -> Any:
    """``torch.load`` with ``mmap=True``: the pickle (names, shapes, small objects) is parsed, the
    tensor bytes stay on disk until a tensor is used. Checkpoints hold pickled Python objects
    (Megatron's ``args``, DeepSpeed's config), so ``weights_only=False``: scan only checkpoints
    you trust, as training itself does when it resumes from them. Files in the pre-1.6 legacy
    (non-zip) format cannot be mapped and are loaded whole, with a notice."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc) and "zip" not in str(exc):
            raise ScanInputError(f"{path}: cannot read it ({exc}); expected {expected}.") from None
        logger.warning("%s: not a zip-format torch file, loading it whole (no memory map)", path)
    except Exception as exc:  # noqa: BLE001 -- truncated, not a torch file, missing classes
        raise ScanInputError(f"{path}: cannot read it ({type(exc).__name__}: {exc}); expected {expected}.") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise ScanInputError(f"{path}: cannot read it ({type(exc).__name__}: {exc}); expected {expected}.") from None


def tensor_at(state: Any, key: str, path: str) -> torch.Tensor:
    """``state[key]`` copied out of the memory map (float dtypes as stored)."""
    value = state.get(key) if isinstance(state, dict) else None
    if not isinstance(value, torch.Tensor):
        raise ScanInputError(f"{path}: no tensor {key!r} (found {type(value).__name__}).")
    return value.detach().clone()
