"""Training data: a byte-level token stream and a deterministic, DP-disjoint sampler.

Two sources, one interface (:class:`TokenStream`, a flat sequence of token ids):

* **Default: the Python standard library corpus.** Every machine with Python has it. The ``.py``
  files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded), in sorted
  relative-path order, each file's UTF-8 bytes followed by the end-of-document token, until
  ``--corpus-max-bytes`` (default 4 MiB). Tokens are bytes 0..255 plus ``EOD = 256`` (vocab 257).
  The corpus differs between Python releases; within one interpreter it is deterministic.
* **``--data-path PREFIX``: a Megatron indexed dataset** (``PREFIX.bin``/``PREFIX.idx``, e.g. from
  ``tools/build_indexed_dataset.py``), read with ``megatron.core.datasets.indexed_dataset.
  IndexedDataset`` directly: its sequences are concatenated into one stream. (We do not use
  ``GPTDataset``/``BlendedMegatronDatasetBuilder``: they need a tokenizer object and write
  index caches; a fixed-window sampler is all this example needs.)

Sampling (:class:`SampleSchedule`): the stream is cut into non-overlapping windows of
``seq_length + 1`` tokens; windows are visited in a permutation seeded by ``(seed, epoch)``. The
global batch of iteration ``t`` (1-based) holds global samples ``[(t-1)*GBS, t*GBS)``; data-parallel
rank ``r`` reads the ``r``-th contiguous slice of it, micro-batch by micro-batch. Batches are a
pure function of (seed, iteration), so resuming at iteration ``t`` needs no data-loader state.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Iterator, Protocol

import numpy as np
import torch

EOD = 256
BYTE_VOCAB_SIZE = 257


class TokenStream(Protocol):
    def __len__(self) -> int: ...

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64."""


class ArrayStream:
    """A token stream held in memory."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def window(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start:start + length].astype(np.int64)


def stdlib_sources(max_bytes: int) -> list[str]:
    """Sorted stdlib ``.py`` paths whose total size reaches ``max_bytes`` (site-packages skipped)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    found.sort(key=lambda p: os.path.relpath(p, root))
    chosen, total = [], 0
    for path in found:
        if total >= max_bytes:
            break
        chosen.append(path)
        total += os.path.getsize(path)
    return chosen


def byte_tokens(paths: list[str], max_bytes: int) -> np.ndarray:
    """Concatenate files as byte tokens, each followed by EOD, truncated to ``max_bytes`` tokens."""
    parts, total = [], 0
    for path in paths:
        with open(path, "rb") as f:
            data = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int32)
        parts.append(np.concatenate([data, np.array([EOD], dtype=np.int32)]))
        total += parts[-1].size
        if total >= max_bytes:
            break
    if not parts:
        raise ValueError("no text found for the byte-level corpus.")
    return np.concatenate(parts)[:max_bytes]


def corpus_fingerprint(tokens: np.ndarray) -> str:
    """First 16 hex digits of the SHA-256 of a token array: the default corpus is this Python's
    standard library, so runs on another Python release train on other data (and give other
    numbers); the fingerprint says whether two machines trained on the same bytes."""
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]


def stdlib_corpus(max_bytes: int) -> ArrayStream:
    """The default corpus (see the module docstring)."""
    return ArrayStream(byte_tokens(stdlib_sources(max_bytes), max_bytes))


class IndexedStream:
    """All sequences of a Megatron ``IndexedDataset``, concatenated into one stream."""

    def __init__(self, path_prefix: str) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        if not IndexedDataset.exists(path_prefix):
            raise ValueError(f"--data-path {path_prefix!r}: no {path_prefix}.bin/.idx found; "
                             "build one with tools/build_indexed_dataset.py.")
        self.dataset = IndexedDataset(path_prefix)
        lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        out, pos, end = [], start, start + length
        seq = int(np.searchsorted(self.starts, start, side="right") - 1)
        while pos < end:
            offset = pos - int(self.starts[seq])
            take = min(end - pos, int(self.starts[seq + 1]) - pos)
            out.append(np.asarray(self.dataset.get(seq, offset=offset, length=take)))
            pos += take
            seq += 1
        return np.concatenate(out).astype(np.int64)


def open_stream(data_path: str | None, corpus_max_bytes: int) -> TokenStream:
    return IndexedStream(data_path) if data_path else stdlib_corpus(corpus_max_bytes)


class SampleSchedule:
    """Maps (iteration, dp rank, micro-batch) to token windows; see the module docstring."""

    def __init__(self, stream: TokenStream, seq_length: int, seed: int) -> None:
        self.stream = stream
        self.seq_length = seq_length
        self.seed = seed
        self.num_windows = (len(stream) - 1) // seq_length
        if self.num_windows < 1:
            raise ValueError(f"corpus of {len(stream)} tokens is shorter than --seq-length + 1.")
        self._perm_epoch = -1
        self._perm = None

    def _window_index(self, global_sample: int) -> int:
        epoch, i = divmod(global_sample, self.num_windows)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_windows, generator=gen).numpy()
            self._perm_epoch = epoch
        return int(self._perm[i])

    def sample(self, global_sample: int) -> np.ndarray:
        start = self._window_index(global_sample) * self.seq_length
        return self.stream.window(start, self.seq_length + 1)

    def micro_batches(self, iteration: int, global_batch_size: int, micro_batch_size: int,
                      dp_rank: int, dp_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches of DP rank ``dp_rank`` for the 1-based ``iteration``."""
        per_rank = global_batch_size // dp_size
        first = (iteration - 1) * global_batch_size + dp_rank * per_rank
        for m in range(per_rank // micro_batch_size):
            rows = [self.sample(first + m * micro_batch_size + j) for j in range(micro_batch_size)]
            tokens = torch.from_numpy(np.stack(rows))
            yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
