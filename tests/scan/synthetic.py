"""Small torch_dist checkpoint series written in-process (seconds, no training): what the scan's
input and output checks need when the monitors' values do not matter.

The files are a real ``torch.distributed.checkpoint`` store, as megatron-core writes it: the
stacked ``decoder.layers.self_attention.linear_qkv.weight`` ``[layers, 3 * heads * head_dim,
hidden]`` (MHA: q, k, v rows per head group), one ``iter_XXXXXXX`` folder per save and the
tracker file. The weights take small random steps between saves.
"""

from __future__ import annotations

import warnings
from pathlib import Path

HEADS = 4
LAYERS = 2


def write_series(root: Path, iterations: list[int], head_dim: int = 8, hidden: int = 32, seed: int = 0) -> Path:
    """``root`` as a Megatron run folder with one torch_dist checkpoint per iteration."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from mechmon_megatron.scan.readers.torch_dist import QKV_KEY

    gen = torch.Generator().manual_seed(seed)
    qkv = 0.02 * torch.randn(LAYERS, 3 * HEADS * head_dim, hidden, generator=gen)
    root.mkdir(parents=True, exist_ok=True)
    for iteration in iterations:
        qkv = qkv + 1e-3 * torch.randn(qkv.shape, generator=gen)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # one process: intended
            dcp.save({QKV_KEY: qkv.clone()}, storage_writer=FileSystemWriter(str(root / f"iter_{iteration:07d}")),
                     no_dist=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iterations[-1]))
    return root
