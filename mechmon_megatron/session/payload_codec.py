"""A reporting rank's check records as numbers in a fixed layout, with their schema apart.

At every check a reporting rank's :class:`~mechmon_megatron.session.records.Payload` has the same
structure (its layers, the names and reductions of its partial scalars, its detector streams with
family, layer, member and head): only the numbers change. :func:`encode` splits a payload into

* ``schema``: the structure, a hashable tuple; sent to the writer only when it differs from the
  one this rank sent last (the first check, or a check at which a site failed or skipped);
* ``values``: the numbers, in schema order (float64 on the wire: exact for Python floats):
  ``overhead_s``; then ``value, count`` of every partial; then every stream's ``value`` and, for
  a stream with an absolute limit, the ``limit``;
* ``extras``: objects that only an alarm carries: non-finite reports, and the reason text of a
  stream beyond its limit (``{stream index: reason}``); empty on a healthy check.

:func:`decode` rebuilds the payload on the writer; ``decode(*encode(p)) == p`` up to the reason
text of streams within their limits (the detector reads a reason only beyond the limit).
"""

from __future__ import annotations

from typing import Any

from mechmon_megatron.detect.families import FAMILY_BY_NAME
from mechmon_megatron.session.records import Partial, Payload, Stream

Schema = tuple
"""``(rank, layers, scalars, streams)``: see :func:`schema_of`."""


def schema_of(payload: Payload) -> Schema:
    """The structure of ``payload``: everything but its numbers (hashable, comparable)."""
    layers = tuple((family, tuple(numbers)) for family, numbers in sorted(payload.layers.items()))
    scalars = tuple(tuple((name, part.reduction) for name, part in group.items()) for group in payload.scalars)
    streams = tuple((s.name, str(s.family), int(s.layer_number), s.member, s.head, s.limit is not None)
                    for s in payload.streams)
    return (int(payload.rank), layers, scalars, streams)


def _beyond(stream: Stream) -> bool:
    if stream.limit is None:
        return False
    spec = FAMILY_BY_NAME.get(str(stream.family))
    direction = spec.direction if spec is not None else "drop"
    return stream.value < stream.limit if direction == "drop" else stream.value > stream.limit


def encode(payload: Payload) -> tuple[Schema, list[float], dict[str, Any]]:
    """``(schema, values, extras)`` of ``payload`` (see the module docstring)."""
    values = [float(payload.overhead_s)]
    for group in payload.scalars:
        for part in group.values():
            values += [float(part.value), float(part.count)]
    reasons = {}
    for index, stream in enumerate(payload.streams):
        values.append(float(stream.value))
        if stream.limit is not None:
            values.append(float(stream.limit))
        if _beyond(stream) and stream.limit_reason:
            reasons[index] = stream.limit_reason
    extras: dict[str, Any] = {}
    if payload.nonfinite:
        extras["nonfinite"] = list(payload.nonfinite)
    if reasons:
        extras["reasons"] = reasons
    return schema_of(payload), values, extras


def decode(schema: Schema, values: list[float], extras: dict[str, Any]) -> Payload:
    """The payload of ``schema`` with ``values`` and ``extras`` (the writer's side of :func:`encode`)."""
    rank, layers, scalar_groups, streams = schema
    expected = 1 + 2 * sum(len(g) for g in scalar_groups) + sum(2 if s[5] else 1 for s in streams)
    if len(values) != expected:
        raise ValueError(f"rank {rank}'s check records have {len(values)} numbers, its schema {expected}")
    it = iter(values)
    overhead = next(it)
    scalars = [{name: Partial(reduction, next(it), next(it)) for name, reduction in group} for group in scalar_groups]
    reasons = extras.get("reasons", {})
    out_streams = []
    for index, (name, family, layer, member, head, has_limit) in enumerate(streams):
        value = next(it)
        limit = next(it) if has_limit else None
        out_streams.append(Stream(name=name, family=family, value=value, layer_number=layer, member=member, head=head,
                                  limit=limit, limit_reason=reasons.get(index, "")))
    return Payload(rank=rank, layers={family: list(numbers) for family, numbers in layers}, scalars=scalars,
                   streams=out_streams, nonfinite=list(extras.get("nonfinite", [])), overhead_s=overhead)
