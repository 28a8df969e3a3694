"""The callback API of the example trainer (the monitoring session's integration point).

A callback is any object with some of these optional methods; all are called on every rank:

* ``on_train_start(ctx: TrainContext)`` -- once, after the model, optimizer and (on ``--load``)
  the checkpoint are ready.
* ``on_step_start(iteration: int)`` -- before the forward of the step that completes
  ``iteration`` (1-based).
* ``on_step_end(iteration: int, ctx: TrainContext) -> None | ExitRequest`` -- after
  ``optimizer.step()`` and the iteration increment. Returning an :class:`ExitRequest` makes the
  loop save (when ``save`` and ``--save``), call ``on_exit`` and exit with ``exit_code``. Ranks
  must agree among themselves: the loop does not reduce the decision.
* ``on_checkpoint_saved(iteration, checkpoint_dir)`` -- after every regular save.
* ``step_metrics() -> dict`` -- extra values for this step's metrics row (every rank calls it,
  so it may run a collective; the last rank writes the row).
* ``on_exit(request: ExitRequest, checkpoint_dir: str | None)`` -- before the process group is
  destroyed (also called with a normal-completion request at the end of training).
* ``state_dict() -> dict`` / ``load_state_dict(sd)`` -- stored in the checkpoint's extra state
  under the callback's ``name`` attribute (default: the class name), restored on ``--load``
  before ``on_train_start``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


@dataclass
class ExitRequest:
    """Ask the loop to stop after this iteration."""

    save: bool = True
    """Save a checkpoint at this iteration first (needs ``--save``)."""
    exit_code: int = 0
    """Process exit status."""
    reason: str = ""
    """Human-readable cause, logged on rank 0."""


@dataclass
class TrainContext:
    """What callbacks may read (and ``save_fn`` to checkpoint now, collectively)."""

    args: argparse.Namespace
    model_chunks: list
    """DDP-wrapped model chunks (``chunk.module`` is the GPTModel)."""
    optimizer: Any
    iteration: int
    """Iterations completed so far."""
    tensorboard_writer: Any
    """``SummaryWriter`` on the last rank, else None."""
    save_fn: Callable[[int], Optional[str]]
    """``save_fn(iteration)``: save a checkpoint now; all ranks must call it. Returns its dir."""


def callback_name(callback: Any) -> str:
    return getattr(callback, "name", type(callback).__name__)


class CallbackList:
    """Dispatches hooks to callbacks that define them."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = list(callbacks)
        names = [callback_name(c) for c in self.callbacks]
        if len(set(names)) != len(names):
            raise ValueError(f"callback names must be unique (set a `name` attribute): {names}")

    def _each(self, hook: str):
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if fn is not None:
                yield fn

    def on_train_start(self, ctx: TrainContext) -> None:
        for fn in self._each("on_train_start"):
            fn(ctx)

    def on_step_start(self, iteration: int) -> None:
        for fn in self._each("on_step_start"):
            fn(iteration)

    def on_step_end(self, iteration: int, ctx: TrainContext) -> Optional[ExitRequest]:
        request = None
        for fn in self._each("on_step_end"):
            result = fn(iteration, ctx)
            if result is not None and request is None:
                # Duck-typed: any object with save / exit_code / reason (e.g. mechmon's request).
                request = ExitRequest(save=bool(result.save), exit_code=int(result.exit_code),
                                      reason=str(getattr(result, "reason", "")))
        return request

    def on_checkpoint_saved(self, iteration: int, checkpoint_dir: Optional[str]) -> None:
        for fn in self._each("on_checkpoint_saved"):
            fn(iteration, checkpoint_dir)

    def step_metrics(self) -> dict[str, Any]:
        """Extra per-step values for the metrics row (called on every rank: may be collective)."""
        out: dict[str, Any] = {}
        for fn in self._each("step_metrics"):
            out.update(fn())
        return out

    def on_exit(self, request: ExitRequest, checkpoint_dir: Optional[str]) -> None:
        for fn in self._each("on_exit"):
            fn(request, checkpoint_dir)

    def state_dict(self) -> dict[str, Any]:
        return {callback_name(c): c.state_dict() for c in self.callbacks
                if hasattr(c, "state_dict")}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for callback in self.callbacks:
            name = callback_name(callback)
            if name in states and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(states[name])
