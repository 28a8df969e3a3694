"""Row layout of megatron-core's fused ``linear_qkv`` weight (pure index arithmetic, no megatron).

With ``np`` query heads, ``ng`` query groups, ``r = np // ng`` heads per group and ``hn`` channels
per head, the weight has ``ng * (r + 2) * hn`` rows (``ng * (2r + 2) * hn`` with an attention
output gate), grouped by query group: for group g the block is
``[q heads g*r .. g*r+r-1 | (gates x r) | k_g | v_g]``, each entry ``hn`` rows.
Tensor parallelism shards the rows contiguously, so a rank holding whole groups sees the same
layout with its local ``np / tp`` heads and ``ng / tp`` groups.
"""

from __future__ import annotations

import torch


def qkv_row_indices(
    num_heads: int, num_groups: int, head_dim: int, output_gate: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of each query head and each key group in the fused QKV weight.

    Returns ``q_rows`` ``[num_heads, head_dim]`` and ``k_rows`` ``[num_groups, head_dim]`` (int64),
    so ``weight[q_rows]`` is ``[num_heads, head_dim, hidden]``.
    """
    if num_groups <= 0 or num_heads % num_groups != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_query_groups ({num_groups})")
    per_group = num_heads // num_groups
    block = (2 * per_group + 2 if output_gate else per_group + 2) * head_dim
    channel = torch.arange(head_dim)
    group_start = torch.arange(num_groups) * block
    head_in_group = torch.arange(num_heads) % per_group
    q_rows = (group_start.repeat_interleave(per_group) + head_in_group * head_dim)[:, None] + channel
    k_offset = (2 * per_group if output_gate else per_group) * head_dim
    k_rows = (group_start + k_offset)[:, None] + channel
    return q_rows, k_rows


def split_qk(
    weight: torch.Tensor, num_heads: int, num_groups: int, head_dim: int, output_gate: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[rows, hidden]`` -> ``wq`` ``[num_heads, head_dim, hidden]`` and
    ``wk`` ``[num_groups, head_dim, hidden]``."""
    q_rows, k_rows = qkv_row_indices(num_heads, num_groups, head_dim, output_gate)
    expected = num_groups * ((2 if output_gate else 1) * (num_heads // num_groups) + 2) * head_dim
    if weight.shape[0] != expected:
        raise ValueError(
            f"linear_qkv weight has {weight.shape[0]} rows, expected {expected} for {num_heads} heads, "
            f"{num_groups} query groups, head_dim {head_dim}, output_gate={output_gate}"
        )
    return weight[q_rows.to(weight.device)], weight[k_rows.to(weight.device)]
