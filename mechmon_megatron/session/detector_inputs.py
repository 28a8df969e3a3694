"""The detector's inputs, from the session's streams online or from recorded scalars offline.

Online, a stream names its family, layer and member itself (:func:`stream_observation`).
Offline, a replay of ``mechmon_scalars.jsonl`` (with ``--mechmon-per-head-scalars``) has names
only: :func:`observation` parses them back, and the same observation results, so the replay feeds
the detector exactly what the session fed it online (``tests/research/study/test_online_replay.py``).

The names come from the family table (``detect/families.py``): a family reads
``mechmon/<monitor>/<scalar>/layer_L`` for each of its ``scalars`` (member: the scalar), or
``mechmon/<monitor>/<scalar>/layer_L/head_H`` when it is ``per_head`` (member: ``head_H``); a
family with a ``limit_scalar`` (the routing entropy) finds its absolute limit in
``mechmon/<monitor>/<limit_scalar>/layer_L``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Optional

from mechmon_megatron.detect.families import FAMILIES, FAMILY_BY_NAME, FamilySpec
from mechmon_megatron.detect.phase_moments import attention_kind_of
from mechmon_megatron.detect.pooled_cusum import Observation
from mechmon_megatron.session import names
from mechmon_megatron.session.records import Stream

__all__ = ["observation", "observations_from_scalars", "stream_family", "stream_observation"]


def _pattern(spec: FamilySpec) -> re.Pattern[str]:
    """The stream names of one family: groups (scalar, layer[, head member])."""
    scalars = "|".join(re.escape(s) for s in spec.scalars)
    head = r"/(head_\d+)" if spec.per_head else ""
    return re.compile(rf"^{names.PREFIX}/{spec.monitor}/({scalars})/layer_(\d+){head}$")


_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple((_pattern(spec), spec.name) for spec in FAMILIES)


def _parse(name: str) -> Optional[tuple[str, int, str]]:
    for pattern, family in _PATTERNS:
        match = pattern.match(name)
        if match:
            groups = match.groups()
            member = groups[2] if len(groups) == 3 else groups[0]
            return family, int(groups[1]), member
    return None


def stream_family(name: str) -> Optional[str]:
    """Detector family of a scalar name, or None if the detector does not judge it."""
    parsed = _parse(name)
    return parsed[0] if parsed else None


def observation(
    name: str, value: float, limit: Optional[float] = None, limit_reason: str = ""
) -> Optional[Observation]:
    """The detector observation of one named stream value (None if not a detector stream)."""
    parsed = _parse(name)
    if parsed is None:
        return None
    family, layer, member = parsed
    return Observation(
        family=family, layer=layer, member=member, value=float(value), limit=limit, limit_reason=limit_reason
    )


def stream_observation(stream: Stream) -> Optional[Observation]:
    """The detector observation of one online stream, from its typed fields (no name parsing);
    a record without a member (written before it existed) falls back to its name."""
    if not stream.member:
        return observation(stream.name, stream.value, stream.limit, stream.limit_reason)
    family = str(stream.family)
    if family not in FAMILY_BY_NAME:
        return None
    return Observation(family=family, layer=int(stream.layer_number), member=stream.member, value=float(stream.value),
                       limit=stream.limit, limit_reason=stream.limit_reason)


def observations_from_scalars(scalars: Mapping[str, float]) -> list[Observation]:
    """Every detector observation in one check's recorded scalars (sorted by name)."""
    out = []
    for name in sorted(scalars):
        parsed = _parse(name)
        if parsed is None:
            continue
        family, layer, member = parsed
        spec = FAMILY_BY_NAME[family]
        limit = None
        if spec.limit_scalar is not None:
            limit = scalars.get(f"{names.PREFIX}/{spec.monitor}/{spec.limit_scalar}/layer_{layer}")
        out.append(Observation(family=family, layer=layer, member=member, value=float(scalars[name]), limit=limit))
    return out


MLA_MARKER = f"{names.PREFIX}/attn/delta2_whole_entropy/"
"""Written only for multi-head latent attention layers (``session/mla_check.py``)."""


def attention_kind(checks: Iterable[tuple[int, Mapping[str, float]]]) -> str:
    """The attention kind a recorded run's phase moments hold for (``detect.phase_moments``): latent
    when its checks hold a latent-attention layer's scalars."""
    return attention_kind_of(any(name.startswith(MLA_MARKER) for _, scalars in checks for name in scalars))
