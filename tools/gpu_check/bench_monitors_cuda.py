"""``tools/bench_monitors.py`` with its layer on a chosen device (the GPU check runs it on CUDA).

    python tools/gpu_check/bench_monitors_cuda.py --device cuda --hidden 8192 --num-heads 64 \
        --head-dim 128 --num-groups 8 --dense-heads 1 --json

Every other flag is ``bench_monitors.py``'s. The benchmark builds its synthetic layer on the CPU;
here the four weight tensors are moved to ``--device`` before any kernel runs, and each timed call
ends with a device synchronisation (``bench_monitors.timed``). The one dense-reference timing is
not wrapped by ``timed``; its last kernels may still be queued when its clock stops (at most the
tail of one d x d SVD; the accuracy check right after it synchronises). The JSON gains ``device``
and ``device_name``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from types import ModuleType
from typing import Optional, Sequence

import torch


def _load_bench_monitors() -> ModuleType:
    """``tools/bench_monitors.py``, a sibling script rather than a package module, loaded from its
    file; mechmon_megatron itself comes from the installed package (``make venv``) or, on the GPU
    machine, from the checkout that tools/gpu_check.sh puts on ``PYTHONPATH``."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_monitors.py")
    spec = importlib.util.spec_from_file_location("bench_monitors", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench_monitors = _load_bench_monitors()


def main(argv: Optional[Sequence[str]] = None) -> dict:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    known, rest = pre.parse_known_args(argv)
    device = torch.device(known.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_monitors_cuda: --device cuda but torch sees no CUDA device")
    make_layer, timed = bench_monitors.make_layer, bench_monitors.timed

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def make_layer_on_device(args):
        return tuple(t.to(device) for t in make_layer(args))

    def timed_synchronised(fn, repeats):
        return timed(lambda: (fn(), sync())[0], repeats)

    # The same patched path on every device, so the CPU test exercises what the GPU check runs.
    bench_monitors.make_layer = make_layer_on_device
    bench_monitors.timed = timed_synchronised
    args = bench_monitors.parse_args(rest)
    report = bench_monitors.run(args)
    report["device"] = device.type
    report["device_name"] = torch.cuda.get_device_name() if device.type == "cuda" else report["machine"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        bench_monitors.print_table(report)
    return report


if __name__ == "__main__":
    main()
