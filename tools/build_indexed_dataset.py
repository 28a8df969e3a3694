"""Build a Megatron indexed dataset (PREFIX.bin / PREFIX.idx) of byte-level tokens.

Each input text file becomes one document: its UTF-8 bytes (tokens 0..255) followed by the
end-of-document token 256 (vocab 257), written with megatron-core's ``IndexedDatasetBuilder``.
Directories are searched recursively for ``--suffix`` files, in sorted order. Use the prefix as
the trainer's ``--data-path``::

    python tools/build_indexed_dataset.py --output-prefix data/corpus_bytes mechmon_megatron tools
    python examples/pretrain_scripts/pretrain_gpt_mechmon.py --data-path data/corpus_bytes
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterable, Optional, Sequence

import numpy as np

EOD = 256


def iter_files(inputs: Iterable[str], suffix: str) -> list[str]:
    files = []
    for path in inputs:
        if os.path.isdir(path):
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                files.extend(os.path.join(dirpath, f) for f in sorted(filenames)
                             if f.endswith(suffix))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"input {path!r} is neither a file nor a directory.")
    return files


def build(files: Sequence[str], output_prefix: str, max_bytes: Optional[int] = None) -> int:
    """Write the dataset; returns the number of tokens written."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    parent = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(parent, exist_ok=True)
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=np.uint16)
    total = 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        if not data:
            continue
        tokens = np.concatenate([np.frombuffer(data, dtype=np.uint8).astype(np.uint16),
                                 np.array([EOD], dtype=np.uint16)])
        builder.add_document(tokens, [tokens.size])
        total += tokens.size
        if max_bytes is not None and total >= max_bytes:
            break
    if total == 0:
        raise ValueError("no non-empty input files: nothing to write.")
    builder.finalize(output_prefix + ".idx")
    return total


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", help="Text files or directories.")
    parser.add_argument("--output-prefix", required=True, help="Writes PREFIX.bin/PREFIX.idx.")
    parser.add_argument("--suffix", default=".py", help="File suffix searched in directories.")
    parser.add_argument("--max-bytes", type=int, default=None, help="Stop after this many tokens.")
    args = parser.parse_args(argv)
    files = iter_files(args.inputs, args.suffix)
    total = build(files, args.output_prefix, args.max_bytes)
    print(f"wrote {total} tokens from {len(files)} files to {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
