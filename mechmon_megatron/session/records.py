"""Records a check produces on each rank and the writer rank combines.

* :class:`Partial` -- one scalar's contribution from one rank, with the reduction that combines
  it across ranks (``mean``: a sum and a count; ``min``; ``value``: produced by one rank only);
* :class:`Stream` -- one detector input (a series value at this check, with its attribution);
* :class:`NonFinite` -- a non-finite weight or logit report, naming its layer;
* :class:`CheckOutput` -- what one site's check returns: scalars, streams, non-finite reports.

All are plain dataclasses: they travel from every rank to the writer in one gather (pickled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

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
    value: float
    layer_number: int
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
