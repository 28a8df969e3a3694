"""Configuration of the biased-rounding fault injector for the emulated low-precision FA backward.

Pure Python: no torch, megatron or deepspeed import.

What the injector does (docs/METHOD.md section 8). In the FlashAttention backward,
``delta = rowsum(dO * O)`` is computed from the low-precision output O. Qiu & Yao trace the
loss explosion of BF16 FlashAttention training to a *biased* rounding of O on rows whose score
maximum is tied. A tiny CPU model rarely produces such ties by itself, so the injector forces a
directed rounding of the O that enters ``delta``::

    O_used = bf16(O) + strength * ulp_bf16(O) * sign(O)

The forward output is never changed and no weight is ever written: the fault acts only through
the attention backward, exactly where the real failure acts.

Modes:

- ``"tied_rows"`` (faithful): the bias is applied only on rows whose score row-max is attained
  more than once, i.e. where the real kernel has several ``P_bar == 1`` entries. On small
  models such rows are rare; in a scratch experiment this variant never triggered a failure.
- ``"all_rows"`` (amplified, *not* faithful): the bias is applied on every row. This is an
  artificial, amplified fault used to make a small model fail within a CPU budget. In a scratch
  experiment ``|strength| >= 8`` on all rows diverged a small model in about 1.5k-4k steps,
  while ``|strength| = 4`` had no visible effect. Results obtained with this mode must be
  reported as obtained under an amplified fault.

Step counter. The injector switches on at ``onset_step``. The trainer owns the step and must
call :meth:`FaultConfig.set_step` once per iteration, before that iteration's forward pass.
Every attention layer built from the same spec holds a reference to the same ``FaultConfig``
object, so one call updates all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

FaultMode = Literal["all_rows", "tied_rows"]
FAULT_MODES: tuple[str, ...] = ("all_rows", "tied_rows")


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """Biased rounding of O in the FA backward's ``delta``; off while ``strength == 0``."""

    strength: float = 0.0
    """Bias added to ``bf16(O)`` in units of one BF16 ulp of O, signed along ``sign(O)``
    (positive rounds away from zero, as the real fault does). ``0.0`` disables the injector."""

    onset_step: int = 0
    """First training step (as passed to :meth:`set_step`) at which the fault is active."""

    mode: FaultMode = "all_rows"
    """``"all_rows"`` (amplified fault) or ``"tied_rows"`` (faithful: rows with a tied max)."""

    layer_numbers: tuple[int, ...] | None = None
    """Global 1-based layer numbers (megatron ``layer_number``) that receive the fault;
    ``None`` means every layer built with this config."""

    current_step: int = 0
    """Mutable: the trainer's current step. Update it with :meth:`set_step` every iteration."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.strength):
            raise ValueError(
                f"fault.strength must be a finite number of BF16 ulps, got {self.strength}."
            )
        if self.onset_step < 0:
            raise ValueError(f"fault.onset_step must be >= 0, got {self.onset_step}.")
        if self.mode not in FAULT_MODES:
            raise ValueError(f"fault.mode must be one of {FAULT_MODES}, got {self.mode!r}.")
        if self.layer_numbers is not None:
            self.layer_numbers = tuple(int(n) for n in self.layer_numbers)
            if any(n < 1 for n in self.layer_numbers):
                raise ValueError(
                    f"fault.layer_numbers are 1-based global layer numbers, got {self.layer_numbers}."
                )

    @property
    def enabled(self) -> bool:
        """True when the injector can ever fire (non-zero strength)."""
        return self.strength != 0.0

    def set_step(self, step: int) -> None:
        """Record the trainer's current iteration; call once per step before the forward."""
        self.current_step = int(step)

    def applies_to_layer(self, layer_number: int) -> bool:
        """Whether the layer with this global 1-based number is targeted."""
        return self.layer_numbers is None or layer_number in self.layer_numbers

    def is_active(self) -> bool:
        """Whether the fault fires at the current step (enabled and past the onset)."""
        return self.enabled and self.current_step >= self.onset_step
