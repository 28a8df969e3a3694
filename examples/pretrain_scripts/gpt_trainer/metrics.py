"""Per-iteration metrics: TensorBoard scalars, a JSONL file and a Megatron-style log line.

Written by the last rank only (as Megatron-LM's ``get_tensorboard_writer``): it sits on the last
pipeline stage, where the loss is known. TensorBoard scalars use Megatron's names: ``lm loss``,
``grad-norm``, ``learning-rate``. JSONL keys: ``iteration``, ``lm_loss``, ``grad_norm``, ``lr``,
``step_time_s``, ``wall_time`` (Unix time when the row was written).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Optional


def is_writer_rank(rank: int, world_size: int) -> bool:
    return rank == world_size - 1


class MetricsWriter:
    def __init__(self, args: argparse.Namespace, enabled: bool) -> None:
        self.args = args
        self.enabled = enabled
        self.tensorboard: Any = None
        self._jsonl = None
        if not enabled:
            return
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=10)
        if args.metrics_jsonl:
            parent = os.path.dirname(os.path.abspath(args.metrics_jsonl))
            os.makedirs(parent, exist_ok=True)
            self._jsonl = open(args.metrics_jsonl, "a", encoding="utf-8")

    def write(self, iteration: int, lm_loss: float, grad_norm: Optional[float], lr: float,
              step_time_s: float, extra: Optional[dict] = None) -> None:
        if not self.enabled:
            return
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("lm loss", lm_loss, iteration)
            if grad_norm is not None:
                self.tensorboard.add_scalar("grad-norm", grad_norm, iteration)
            self.tensorboard.add_scalar("learning-rate", lr, iteration)
        if self._jsonl is not None:
            row = {"iteration": iteration, "lm_loss": lm_loss, "grad_norm": grad_norm, "lr": lr,
                   "step_time_s": step_time_s, "wall_time": time.time(), **(extra or {})}
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if iteration % self.args.log_interval == 0:
            gn = "nan" if grad_norm is None else f"{grad_norm:.3f}"
            print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/"
                  f"{self.args.train_iters:8d} | consumed samples: "
                  f"{iteration * self.args.global_batch_size:12d} | elapsed time per iteration "
                  f"(ms): {step_time_s * 1000:.1f} | learning rate: {lr:.6E} | global batch size: "
                  f"{self.args.global_batch_size:5d} | lm loss: {lm_loss:.6E} | grad norm: {gn} |",
                  flush=True)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()
            self.tensorboard.close()
            self.tensorboard = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
