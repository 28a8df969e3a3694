"""Read a full parameter on every ZeRO stage (0, 1, 2, 3) with DeepSpeed's safe accessors.

* ZeRO 1/2 (and the bf16 optimizer): ``deepspeed.utils.safe_get_full_fp32_param`` assembles the
  fp32 master weight from the data-parallel partitions -- an all-reduce over the parameter's
  data-parallel group, so EVERY rank of that group must call it, in the same order.
* ZeRO 3: ``safe_get_full_fp32_param`` as well when the parameter is registered with a ZeRO-3
  optimizer; otherwise ``deepspeed.zero.GatheredParameters`` (also a collective).
* ZeRO 0 in fp32: the module parameter is the full weight (no communication).

The result is a detached fp32 copy that does not alias the parameter.
"""

from __future__ import annotations

import torch


def is_zero3_param(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def read_full_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The full fp32 value of ``param`` (a collective under ZeRO; see the module docstring)."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = None
    if not is_zero3_param(param) or getattr(param, "_z3_optimizer", None) is not None:
        full = safe_get_full_fp32_param(param)
    if full is not None:
        return full.detach().float().clone()
    if is_zero3_param(param):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().float().clone()
    return param.detach().float().clone()


def read_is_collective(param: torch.nn.Parameter) -> bool:
    """True when :func:`read_full_param` communicates (every rank of the group must call it)."""
    # ZeRO 1/2 set ``_hp_mapping`` on every parameter of the group (None where this rank holds
    # no fragment): the accessor all-reduces whenever the attribute exists.
    return is_zero3_param(param) or hasattr(param, "_hp_mapping")
