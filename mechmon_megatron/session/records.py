"""Records a check produces on each rank and the writer rank combines.

* :class:`Partial` -- one scalar's contribution from one rank, with the reduction that combines
  it across ranks (``mean``: a sum and a count; ``min``; ``value``: produced by one rank only);
* :class:`Stream` -- one detector input (a series value at this check, with its attribution);
* :class:`NonFinite` -- a non-finite weight or logit report, naming its layer;
* :class:`CheckOutput` -- what one site's check returns: scalars, streams, non-finite reports;
* :class:`Payload` -- what one reporting rank sends the writer at a check;
* :class:`Verdict` -- the writer's decision, returned to every rank;
* :class:`Decision` -- what the host must do after a step (the session's ``on_step_end``).

A stream names its own detector family (``detect/families.py``): no name parsing online.

All are plain dataclasses. At a check every rank adds its failure count and error count to one
small all-reduce; only the ranks that report (own a layer's per-head or full-matrix work, or a
router's report) and the writer gather their payloads; the decision returns as one small tensor,
and only an alarm or a strict stop carries objects (``session/host.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from mechmon_megatron.session.alert import Alert

Reduction = Literal["mean", "min", "value"]


@dataclass(frozen=True)
class Partial:
    """One scalar's contribution from one rank.

    ``mean``: ``value`` is a sum over ``count`` items (the writer divides the total sum by the
    total count); ``min``: the writer keeps the smallest ``value``; ``value``: produced by
    exactly one rank (a duplicate would be identical).
    """

    reduction: Reduction
    value: float
    count: float = 1.0


@dataclass(kw_only=True)
class Stream:
    """One detector input: a named series value at this check, with its attribution (keywords only)."""

    name: str
    family: str
    """The name of its detector family (``FamilySpec.name``, ``detect/families.py``)."""
    value: float
    layer_number: int
    member: str = ""
    """The stream within its layer (``head_H``, ``dw_entropy`` / ``dwk_entropy``, ``token_entropy``,
    ``weight_similarity``); empty in records written before it existed (their name is parsed)."""
    head: Optional[int] = None
    limit: Optional[float] = None
    """Absolute limit in stream units (out of band beyond it until the stream has a baseline), or None."""
    limit_reason: str = ""
    """What crossing ``limit`` means, for the alert."""


@dataclass(frozen=True)
class NonFinite:
    """Non-finite weights or router logits found at one layer (an immediate alarm)."""

    layer_number: Optional[int]
    message: str


@dataclass
class CheckOutput:
    """What one site's check returns on one rank."""

    scalars: dict[str, Partial] = field(default_factory=dict)
    streams: list[Stream] = field(default_factory=list)
    nonfinite: list[NonFinite] = field(default_factory=list)


@dataclass
class Payload:
    """One reporting rank's records of one check (the writer's own included).

    ``layers``: family -> the global layer numbers this rank's sites feed (the job shape);
    ``failures``: the :class:`~mechmon_megatron.session.failures.PhaseFailure` records of this rank
    (sent by every rank, reporting or not, only when some rank failed); ``overhead_s``: session
    seconds since the previous check.
    """

    rank: int
    layers: dict[str, list[int]] = field(default_factory=dict)
    scalars: list[dict[str, Partial]] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    nonfinite: list[NonFinite] = field(default_factory=list)
    overhead_s: float = 0.0


@dataclass
class Verdict:
    """The writer's decision of one check, the same on every rank after the broadcast."""

    alarm: bool = False
    alerts: list[Alert] = field(default_factory=list)
    """The alarms of the check (objects: they travel only when there is an alarm)."""
    stop: Optional[str] = None
    """Under ``--mechmon-strict``: the message every rank raises."""

    @property
    def carries_objects(self) -> bool:
        return bool(self.alerts) or self.stop is not None


@dataclass
class Decision:
    """What the host must do after a step. ``abort``: save on every rank, then exit."""

    iteration: int
    alarm: bool = False
    abort: bool = False
    exit_code: int = 0
    alerts: list[Alert] = field(default_factory=list)
    stop: Optional[str] = None
    """Set under ``--mechmon-strict`` when a monitor failed on some rank: every rank raises it."""


def merge_partials(partials: list[dict[str, Partial]]) -> dict[str, float]:
    """Combine the partials of all ranks into final scalar values (writer side)."""
    acc: dict[str, list] = {}
    for part in partials:
        for name, partial in part.items():
            kind, value, count = partial.reduction, partial.value, partial.count
            if name not in acc:
                acc[name] = [kind, value, count]
            elif kind == "mean":
                acc[name][1] += value
                acc[name][2] += count
            elif kind == "min":
                acc[name][1] = min(acc[name][1], value)
            # "value": produced by exactly one rank; a duplicate would be identical.
    return {name: (v / c if kind == "mean" else v) for name, (kind, v, c) in acc.items()}
