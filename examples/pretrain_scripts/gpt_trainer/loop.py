"""The training loop: forward/backward with megatron-core's pipeline schedules, optimizer and
LR schedule, metrics, checkpoints and the callback hooks (see ``callbacks.py``)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from mechmon_megatron.session.state_format import STATE_KEY

from .callbacks import CallbackList, ExitRequest, TrainContext
from .checkpoint import save_checkpoint
from .data import SampleSchedule
from .metrics import MetricsWriter
from .runtime import shutdown


def _loss_func(output_tensor: torch.Tensor):
    """Sum of per-token losses [b, s] -> (loss_sum, num_tokens, {'lm loss': [sum, count]})."""
    losses = output_tensor.float()
    loss_sum = losses.sum()
    num_tokens = torch.tensor(losses.numel(), dtype=torch.int, device=losses.device)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(),
                                                          num_tokens.float()])}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    output = model(tokens, position_ids, None, labels=labels)
    return output, _loss_func


@dataclass
class Trainer:
    """State of one run; ``run()`` trains from ``iteration`` to ``--train-iters``."""

    args: argparse.Namespace
    model_chunks: list
    optimizer: Any
    scheduler: Any
    schedule: SampleSchedule
    callbacks: CallbackList
    metrics: MetricsWriter
    iteration: int = 0
    last_checkpoint: Optional[str] = None
    """The newest checkpoint this launch saved (for the closing line)."""

    def save(self, iteration: int) -> Optional[str]:
        """Save now (collective); a no-op returning None without ``--save``."""
        if not self.args.save:
            return None
        states = self.callbacks.state_dict()
        # The monitoring session's state goes into the distributed checkpoint under its one key
        # (mechmon's format on every host, session/state_format.py), one shard per rank; other
        # callbacks' into the per-rank extra file.
        extra: dict = {"callbacks": {name: sd for name, sd in states.items() if name != STATE_KEY}}
        return save_checkpoint(self.args.save, iteration, self.model_chunks, self.optimizer,
                               self.scheduler, extra, monitor_state=states.get(STATE_KEY))

    def save_regular(self, iteration: int) -> Optional[str]:
        """A scheduled save (--save-interval / end of training): callbacks hear about it."""
        path = self.save(iteration)
        if path is not None:
            self.last_checkpoint = path
            if torch.distributed.get_rank() == 0:
                print(f"saved checkpoint at iteration {iteration} to {path}", flush=True)
        self.callbacks.on_checkpoint_saved(iteration, path)
        return path

    def context(self) -> TrainContext:
        return TrainContext(args=self.args, model_chunks=self.model_chunks,
                            optimizer=self.optimizer, iteration=self.iteration,
                            tensorboard_writer=self.metrics.tensorboard, save_fn=self.save)

    def _reduced_loss(self, losses: list) -> float:
        """Mean token loss over micro-batches and data-parallel ranks (last stage only)."""
        if not losses:
            return float("nan")
        total = torch.stack([item["lm loss"] for item in losses]).sum(dim=0)
        torch.distributed.all_reduce(
            total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return (total[0] / total[1]).item()

    def train_step(self) -> tuple[float, Optional[float], float]:
        args = self.args
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = self.schedule.micro_batches(
            self.iteration + 1, args.global_batch_size, args.micro_batch_size,
            parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=batches, model=self.model_chunks,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=args.global_batch_size)
        loss = self._reduced_loss(losses) if parallel_state.is_pipeline_last_stage() else float("nan")
        return loss, grad_norm, lr

    def run(self) -> int:
        """Train; returns the exit code (``sys.exit`` is left to ``exit``)."""
        args = self.args
        self.callbacks.on_train_start(self.context())
        last_saved = None
        skip = set(getattr(args, "iterations_to_skip", None) or ())
        while self.iteration < args.train_iters:
            if self.iteration + 1 in skip:
                # Megatron-LM's --iterations-to-skip: the batch of this iteration is not used and
                # the optimizer and LR scheduler do not move; only the counter (and the data) do.
                self.iteration += 1
                if args.save_interval and self.iteration % args.save_interval == 0:
                    self.save_regular(self.iteration)
                    last_saved = self.iteration
                continue
            self.callbacks.on_step_start(self.iteration + 1)
            start = time.perf_counter()
            loss, grad_norm, lr = self.train_step()
            step_time = time.perf_counter() - start
            self.iteration += 1
            self.metrics.write(self.iteration, loss, grad_norm, lr, step_time,
                               extra=self.callbacks.step_metrics())
            request = self.callbacks.on_step_end(self.iteration, self.context())
            if request is None and args.exit_interval and self.iteration % args.exit_interval == 0:
                request = ExitRequest(save=True, exit_code=0, reason="--exit-interval reached")
            if request is not None:
                return self.exit(request)
            if ((args.save_interval and self.iteration % args.save_interval == 0)
                    or self.iteration in args.save_at_iters):
                self.save_regular(self.iteration)
                last_saved = self.iteration
        path = None
        if args.save and last_saved != self.iteration:
            path = self.save_regular(self.iteration)
        rank0 = torch.distributed.get_rank() == 0
        self._finish(ExitRequest(save=False, exit_code=0, reason="--train-iters reached"), path)
        if rank0:  # after the callbacks' own closing lines (mechmon: checks, alarms, records)
            last = f"; last checkpoint {self.last_checkpoint}" if self.last_checkpoint else ""
            print(f"training done at iteration {self.iteration} (--train-iters reached){last}", flush=True)
        return 0

    def _finish(self, request: ExitRequest, checkpoint_dir: Optional[str]) -> None:
        self.callbacks.on_exit(request, checkpoint_dir)
        self.metrics.close()
        shutdown()

    def exit(self, request: ExitRequest) -> int:
        path = self.save(self.iteration) if request.save else None
        if torch.distributed.get_rank() == 0:
            print(f"exiting at iteration {self.iteration}: {request.reason} "
                  f"(checkpoint: {path}, exit code {request.exit_code})", flush=True)
        self._finish(request, path)
        sys.exit(request.exit_code)
