"""Symptom-level baseline detectors over one scalar stream (docs/METHOD.md section 9).

These are the cheap rules users already run on the loss and the gradient norm; mechmon's claim
is measured against them (same run, same steps: who alarms first, who alarms falsely). Each rule
is our own implementation of the published decision rule, written from its description:

=========================  ==============================================================
``OlmoSpikeRule``          value > mean + 6 sigma of the previous 128 values (OLMo-core)
``MegatronSpikeRule``      |value| >= 10 x max |value| of the first 100 values (Megatron-LM)
``FoundrySpikeRule``       value >= 2 x mean of the previous 100 values for > 4 steps
                           (llm-foundry)
``RunningMeanRelativeRule``  value jumps > rel_jump above a running (EMA) mean (Lightning-style)
``GrowthRule``             value >= factor x median of its first values (max attention logit,
                           W_q spectral norm, parameter norm)
=========================  ==============================================================

Common contract (:class:`SymptomRule`):

- ``update(step, value) -> bool``: True when this value alarms. A rule returns True on every
  value that meets its condition, not only the first; ``first_alarm_step`` keeps the first.
- Non-finite values (NaN, +-inf) always alarm and leave the rule's statistics untouched, so the
  reference window is not poisoned and the rule keeps working if the stream recovers.
- ``state_dict()`` is JSON-serialisable ``{"version": 1, "kind", "config", ...}``;
  ``load_state_dict`` refuses another version, kind or configuration with ``ValueError``.
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar

__all__ = [
    "FoundrySpikeRule",
    "GrowthRule",
    "MegatronSpikeRule",
    "OlmoSpikeRule",
    "RunningMeanRelativeRule",
    "SYMPTOM_STREAMS",
    "SymptomRule",
    "build_symptom_rules",
]

_STATE_VERSION = 1


class SymptomRule(ABC):
    """Base class: bookkeeping, the non-finite policy and versioned state.

    Subclasses implement ``_check(value) -> bool`` (decide on a finite value, then absorb it
    into their statistics), ``_config()``, ``_get_state()`` and ``_set_state()``.
    """

    kind: ClassVar[str] = "symptom"

    def __init__(self, name: str | None = None) -> None:
        self.name: str = name if name is not None else self.kind
        self.first_alarm_step: int | None = None
        self.num_alarms: int = 0
        self.num_updates: int = 0

    def update(self, step: int, value: float) -> bool:
        """Feed one value (any unit) observed at ``step``; True when it alarms."""
        v = float(value)
        alarm = True if not math.isfinite(v) else bool(self._check(v))
        self.num_updates += 1
        if alarm:
            self.num_alarms += 1
            if self.first_alarm_step is None:
                self.first_alarm_step = int(step)
        return alarm

    @abstractmethod
    def _check(self, value: float) -> bool: ...

    @abstractmethod
    def _config(self) -> dict[str, Any]: ...

    @abstractmethod
    def _get_state(self) -> dict[str, Any]: ...

    @abstractmethod
    def _set_state(self, state: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: ``{"version": 1, "kind", "config", "first_alarm_step", ...}``."""
        return {
            "version": _STATE_VERSION,
            "kind": self.kind,
            "config": self._config(),
            "first_alarm_step": self.first_alarm_step,
            "num_alarms": self.num_alarms,
            "num_updates": self.num_updates,
            "state": self._get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; ``ValueError`` on another version, kind or config."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"{self.name}: symptom rule state has version {state.get('version')!r}, expected "
                f"{_STATE_VERSION}; it was written by an incompatible mechmon-megatron."
            )
        if state.get("kind") != self.kind:
            raise ValueError(f"{self.name}: state is for a {state.get('kind')!r} rule, not {self.kind!r}.")
        if state.get("config") != self._config():
            raise ValueError(
                f"{self.name}: saved config {state.get('config')} differs from this rule's "
                f"{self._config()}; build the rule with the saved settings to resume."
            )
        self.first_alarm_step = state["first_alarm_step"]
        self.num_alarms = int(state["num_alarms"])
        self.num_updates = int(state["num_updates"])
        self._set_state(state["state"])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args}, name={self.name!r})"


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


class OlmoSpikeRule(SymptomRule):
    """value > mean + ``num_sigma`` x std of the previous ``window`` finite values.

    No alarm until ``min_history`` values (default: a full ``window``) have been seen. The std is
    the sample std (ddof=1). Every finite value, alarming or not, enters the window (a plain
    rolling z-score). On a perfectly constant history (std 0) any increase alarms.
    """

    kind = "olmo_spike"

    def __init__(
        self, window: int = 128, num_sigma: float = 6.0, min_history: int | None = None, name: str | None = None
    ) -> None:
        super().__init__(name)
        min_history = window if min_history is None else min_history
        _require(window >= 2, f"olmo_spike.window must be >= 2, got {window}.")
        _require(num_sigma > 0, f"olmo_spike.num_sigma must be > 0, got {num_sigma}.")
        _require(
            2 <= min_history <= window, f"olmo_spike.min_history must be in [2, window={window}], got {min_history}."
        )
        self.window, self.num_sigma, self.min_history = int(window), float(num_sigma), int(min_history)
        self._history: deque[float] = deque(maxlen=self.window)

    def _check(self, value: float) -> bool:
        alarm = False
        if len(self._history) >= self.min_history:
            mean = math.fsum(self._history) / len(self._history)
            std = statistics.stdev(self._history, xbar=mean)
            alarm = value > mean + self.num_sigma * std
        self._history.append(value)
        return alarm

    def _config(self) -> dict[str, Any]:
        return {"window": self.window, "num_sigma": self.num_sigma, "min_history": self.min_history}

    def _get_state(self) -> dict[str, Any]:
        return {"history": list(self._history)}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._history = deque((float(x) for x in state["history"]), maxlen=self.window)


class MegatronSpikeRule(SymptomRule):
    """|value| >= ``factor`` x max |value| of the first ``first_n`` finite values.

    The first ``first_n`` finite values only build the reference and never alarm. A zero
    reference makes any non-zero value alarm (strictly greater than the reference is required,
    so an all-zero stream stays quiet).
    """

    kind = "megatron_spike"

    def __init__(self, first_n: int = 100, factor: float = 10.0, name: str | None = None) -> None:
        super().__init__(name)
        _require(first_n >= 1, f"megatron_spike.first_n must be >= 1, got {first_n}.")
        _require(factor > 1, f"megatron_spike.factor must be > 1, got {factor}.")
        self.first_n, self.factor = int(first_n), float(factor)
        self._seen = 0
        self._reference = 0.0

    def _check(self, value: float) -> bool:
        mag = abs(value)
        if self._seen < self.first_n:
            self._seen += 1
            self._reference = max(self._reference, mag)
            return False
        return mag >= self.factor * self._reference and mag > self._reference

    def _config(self) -> dict[str, Any]:
        return {"first_n": self.first_n, "factor": self.factor}

    def _get_state(self) -> dict[str, Any]:
        return {"seen": self._seen, "reference": self._reference}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._seen, self._reference = int(state["seen"]), float(state["reference"])


class FoundrySpikeRule(SymptomRule):
    """value >= ``factor`` x mean of the previous ``window`` values for more than ``patience``
    consecutive steps: alarms on the ``patience + 1``-th such step and on each one after it.

    Checks start once ``min_history`` values (default: a full ``window``) are in the window.
    Every finite value enters the window. A non-finite value alarms but neither extends nor
    breaks the run of high values.
    """

    kind = "foundry_spike"

    def __init__(
        self,
        window: int = 100,
        factor: float = 2.0,
        patience: int = 4,
        min_history: int | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        min_history = window if min_history is None else min_history
        _require(window >= 1, f"foundry_spike.window must be >= 1, got {window}.")
        _require(factor > 0, f"foundry_spike.factor must be > 0, got {factor}.")
        _require(patience >= 0, f"foundry_spike.patience must be >= 0, got {patience}.")
        _require(
            1 <= min_history <= window, f"foundry_spike.min_history must be in [1, window={window}], got {min_history}."
        )
        self.window, self.factor, self.patience = int(window), float(factor), int(patience)
        self.min_history = int(min_history)
        self._history: deque[float] = deque(maxlen=self.window)
        self._run = 0

    def _check(self, value: float) -> bool:
        if len(self._history) >= self.min_history:
            mean = math.fsum(self._history) / len(self._history)
            self._run = self._run + 1 if value >= self.factor * mean else 0
        self._history.append(value)
        return self._run > self.patience

    def _config(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "factor": self.factor,
            "patience": self.patience,
            "min_history": self.min_history,
        }

    def _get_state(self) -> dict[str, Any]:
        return {"history": list(self._history), "run": self._run}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._history = deque((float(x) for x in state["history"]), maxlen=self.window)
        self._run = int(state["run"])


class RunningMeanRelativeRule(SymptomRule):
    """value - m > ``rel_jump`` x |m|, m the bias-corrected EMA (decay ``beta``) of previous values.

    For a positive stream this is value > (1 + rel_jump) x m. No alarm during the first
    ``warmup`` finite values. Every finite value enters the EMA.
    """

    kind = "running_mean_relative"

    def __init__(self, beta: float = 0.99, rel_jump: float = 0.5, warmup: int = 20, name: str | None = None) -> None:
        super().__init__(name)
        _require(0 < beta < 1, f"running_mean_relative.beta must be in (0, 1), got {beta}.")
        _require(rel_jump > 0, f"running_mean_relative.rel_jump must be > 0, got {rel_jump}.")
        _require(warmup >= 1, f"running_mean_relative.warmup must be >= 1, got {warmup}.")
        self.beta, self.rel_jump, self.warmup = float(beta), float(rel_jump), int(warmup)
        self._acc = 0.0
        self._count = 0

    def running_mean(self) -> float:
        """Bias-corrected EMA of the finite values so far (NaN before the first)."""
        if self._count == 0:
            return math.nan
        return self._acc / (1.0 - self.beta**self._count)

    def _check(self, value: float) -> bool:
        alarm = False
        if self._count >= self.warmup:
            m = self.running_mean()
            alarm = value - m > self.rel_jump * abs(m)
        self._acc = self.beta * self._acc + (1.0 - self.beta) * value
        self._count += 1
        return alarm

    def _config(self) -> dict[str, Any]:
        return {"beta": self.beta, "rel_jump": self.rel_jump, "warmup": self.warmup}

    def _get_state(self) -> dict[str, Any]:
        return {"acc": self._acc, "count": self._count}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._acc, self._count = float(state["acc"]), int(state["count"])


class GrowthRule(SymptomRule):
    """value >= ``factor`` x median of the first ``reference_steps`` finite values.

    For positive signals that should stay near their early level: max attention logit, W_q
    spectral norm, parameter norm. The reference values never alarm. Strictly greater than the
    reference is also required, so a zero reference alarms on any positive value but an all-zero
    stream stays quiet.
    """

    kind = "growth"

    def __init__(self, reference_steps: int = 100, factor: float = 3.0, name: str | None = None) -> None:
        super().__init__(name)
        _require(reference_steps >= 1, f"growth.reference_steps must be >= 1, got {reference_steps}.")
        _require(factor > 1, f"growth.factor must be > 1, got {factor}.")
        self.reference_steps, self.factor = int(reference_steps), float(factor)
        self._reference_values: list[float] = []
        self._reference: float | None = None

    @property
    def reference(self) -> float | None:
        """Median of the reference values once complete, else None."""
        return self._reference

    def _check(self, value: float) -> bool:
        if self._reference is None:
            self._reference_values.append(value)
            if len(self._reference_values) == self.reference_steps:
                self._reference = float(statistics.median(self._reference_values))
                self._reference_values = []  # no longer needed; keeps the state small
            return False
        return value >= self.factor * self._reference and value > self._reference

    def _config(self) -> dict[str, Any]:
        return {"reference_steps": self.reference_steps, "factor": self.factor}

    def _get_state(self) -> dict[str, Any]:
        return {"reference_values": list(self._reference_values), "reference": self._reference}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._reference_values = [float(x) for x in state["reference_values"]]
        ref = state["reference"]
        self._reference = None if ref is None else float(ref)


_SPIKE_RULES = ("olmo_spike", "megatron_spike", "foundry_spike", "running_mean_relative")

SYMPTOM_STREAMS: dict[str, tuple[str, ...]] = {
    "loss": _SPIKE_RULES,
    "grad_norm": _SPIKE_RULES,
    "max_attn_logit": ("growth",),
    "wq_spectral_norm": ("growth",),
}
"""Standard stream -> rule kinds built by :func:`build_symptom_rules` (stream names are the
values the session feeds: training loss, global grad norm, max_ij q_i.k_j / sqrt(head_dim),
largest singular value of W_q)."""

_RULE_CLASSES: dict[str, type[SymptomRule]] = {
    cls.kind: cls for cls in (OlmoSpikeRule, MegatronSpikeRule, FoundrySpikeRule, RunningMeanRelativeRule, GrowthRule)
}


def build_symptom_rules(streams: Iterable[str] | None = None) -> dict[str, SymptomRule]:
    """The standard baseline set, keyed ``"<stream>/<rule kind>"`` (also each rule's ``name``).

    Defaults (the published settings; change them by building the rule classes directly):
    olmo_spike window 128, 6 sigma; megatron_spike first 100 values, factor 10; foundry_spike
    window 100, factor 2, patience 4; running_mean_relative beta 0.99, rel_jump 0.5, warmup 20;
    growth first 100 values, factor 3.

    Args:
        streams: subset of :data:`SYMPTOM_STREAMS` keys; None means all of them.
    """
    selected = list(SYMPTOM_STREAMS) if streams is None else list(streams)
    unknown = [s for s in selected if s not in SYMPTOM_STREAMS]
    if unknown:
        raise ValueError(f"unknown symptom streams {unknown}; choose from {sorted(SYMPTOM_STREAMS)}.")
    rules: dict[str, SymptomRule] = {}
    for stream in selected:
        for kind in SYMPTOM_STREAMS[stream]:
            key = f"{stream}/{kind}"
            rules[key] = _RULE_CLASSES[kind](name=key)
    return rules
