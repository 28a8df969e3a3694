"""The detector's inputs, from the session's streams online or from recorded scalars offline.

Online, a stream names its family, layer and member itself (:func:`stream_observation`, typed:
``records.Family``). Offline, a replay of ``mechmon_scalars.jsonl`` (with
``--mechmon-per-head-scalars``) has names only: :func:`observation` parses them back
(the table below), and the same observation results, so the replay feeds the detector exactly
what the session fed it online (``tests/research/study/test_online_replay.py``).

=================  ====================================================  ===================
family             scalar (stream) name                                   member
=================  ====================================================  ===================
``attn_delta2``    ``mechmon/attn/delta2_entropy/layer_L/head_H``        ``head_H``
``attn_dw``        ``mechmon/attn/dw_entropy/layer_L``, ``dwk_entropy``   ``dw_entropy`` ...
``router_entropy`` ``mechmon/router/token_entropy/layer_L``              ``token_entropy``
``router_weights`` ``mechmon/router/weight_similarity/layer_L``          ``weight_similarity``
``attn_delta2_short`` ``mechmon/attn/delta2_entropy_short/layer_L/head_H`` ``head_H``
=================  ====================================================  ===================

(``attn_delta2_short``: only with ``--mechmon-short-window``.)

The routing entropy's absolute limit is ``mechmon/router/token_entropy_floor/layer_L``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Optional

from mechmon_megatron.detect.pooled_cusum import Observation
from mechmon_megatron.session import names
from mechmon_megatron.session.records import Family, Stream

FAMILIES = frozenset(f.value for f in Family)

__all__ = ["observation", "observations_from_scalars", "stream_family", "stream_observation"]

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(rf"^{names.PREFIX}/attn/(delta2_entropy)/layer_(\d+)/(head_\d+)$"), "attn_delta2"),
    (re.compile(rf"^{names.PREFIX}/attn/(dwk?_entropy)/layer_(\d+)$"), "attn_dw"),
    (re.compile(rf"^{names.PREFIX}/router/(token_entropy)/layer_(\d+)$"), "router_entropy"),
    (re.compile(rf"^{names.PREFIX}/router/(weight_similarity)/layer_(\d+)$"), "router_weights"),
    (re.compile(rf"^{names.PREFIX}/attn/(delta2_entropy_short)/layer_(\d+)/(head_\d+)$"), "attn_delta2_short"),
)


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
    family = stream.family.value if isinstance(stream.family, Family) else str(stream.family)
    if family not in FAMILIES:
        return None
    return Observation(family=family, layer=int(stream.layer_number), member=stream.member, value=float(stream.value),
                       limit=stream.limit, limit_reason=stream.limit_reason)


def observations_from_scalars(scalars: Mapping[str, float]) -> list[Observation]:
    """Every detector observation in one check's recorded scalars (sorted by name)."""
    out = []
    for name in sorted(scalars):
        limit = None
        if name.startswith(f"{names.PREFIX}/router/token_entropy/"):
            limit = scalars.get(name.replace("/token_entropy/", "/token_entropy_floor/"))
        obs = observation(name, scalars[name], limit=limit)
        if obs is not None:
            out.append(obs)
    return out
