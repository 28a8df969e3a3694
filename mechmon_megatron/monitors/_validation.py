"""Input checks shared by the spectral monitor kernels (private).

Every check raises ``ValueError`` whose message names the offending argument, so that a caller
(the monitoring session) can report which weight or option was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def check_floating(name: str, tensor: object, ndim: int | None = None, min_ndim: int | None = None) -> Tensor:
    """Check that ``tensor`` is a real floating-point ``torch.Tensor`` of the expected rank.

    Args:
        name: argument name used in error messages.
        tensor: the object to check.
        ndim: exact number of dimensions required (``None``: any).
        min_ndim: minimum number of dimensions required (``None``: any).

    Returns:
        ``tensor`` unchanged (for chaining).
    """
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must have a real floating-point dtype, got {tensor.dtype}.")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)} ({tensor.dim()}-D).")
    if min_ndim is not None and tensor.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(tensor.shape)} "
            f"({tensor.dim()}-D)."
        )
    return tensor


def check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """Raise ``ValueError`` unless ``a`` and ``b`` have the same shape and device."""
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}."
        )
    check_same_device((name_a, a), (name_b, b))


def check_same_device(*named: tuple[str, Tensor]) -> None:
    """Raise ``ValueError`` unless all tensors live on the same device."""
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {first_name} is on {first.device}; "
                "move all weights to one device."
            )


def check_finite(named: Sequence[tuple[str, Tensor]]) -> None:
    """Raise ``ValueError`` naming the first input that contains NaN or Inf.

    All flags are gathered into one tensor so that only one host synchronisation happens,
    whatever the number of inputs (the check runs on the accelerator).
    """
    if not named:
        return
    flags = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()
    for (name, tensor), ok in zip(named, flags):
        if not ok:
            n_bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(
                f"{name} contains {n_bad} non-finite value(s) (NaN or Inf); "
                "the weights are corrupted (non-finite weights), spectra are undefined."
            )
