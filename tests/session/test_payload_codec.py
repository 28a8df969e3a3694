"""A check's records as numbers in a fixed layout: the round trip is exact, the schema
stays the same from check to check on a healthy run, and only an alarm carries objects."""

from __future__ import annotations

import dataclasses
import math

import torch

from mechmon_megatron.detect.families import ROUTER_ENTROPY
from mechmon_megatron.session.attention_check import check_full, check_heads
from mechmon_megatron.session.detector_inputs import observation, stream_observation
from mechmon_megatron.session.host import FullQK, QKWeights
from mechmon_megatron.session.payload_codec import decode, encode
from mechmon_megatron.session.records import NonFinite, Partial, Payload, Stream


def _layer(seed: int, heads: int = 4, groups: int = 2, dim: int = 8, hidden: int = 32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, dim, hidden, generator=g, dtype=torch.float64), \
        torch.randn(groups, dim, hidden, generator=g, dtype=torch.float64)


def _payload(seed: int) -> Payload:
    wq0, wk0 = _layer(0)
    wq1, wk1 = wq0 + 1e-3 * _layer(seed)[0], wk0 + 1e-3 * _layer(seed)[1]
    heads = check_heads(3, QKWeights(wq0, wk0), QKWeights(wq1, wk1), 1.0, "gram", per_head_scalars=True)
    full = check_full(3, FullQK(wq0.reshape(-1, 32), wk0.reshape(-1, 32)), FullQK(wq1.reshape(-1, 32),
                      wk1.reshape(-1, 32)), 1.0, "exact", 4, 0)
    router = Stream(name="mechmon/router/token_entropy/layer_3", family=ROUTER_ENTROPY.name, value=0.5,
                    layer_number=3, member="token_entropy", limit=0.2, limit_reason=f"value {seed}")
    return Payload(rank=5, layers={"attn_delta2": [3], "router_entropy": [3]},
                   scalars=[heads.scalars, full.scalars, {"mechmon/router/eps/layer_3": Partial("value", 0.1)}],
                   streams=[*heads.streams, *full.streams, router], overhead_s=0.25)


def test_round_trip_is_exact_and_the_schema_is_stable():
    first, second = _payload(1), _payload(2)
    schema1, values1, extras1 = encode(first)
    schema2, values2, extras2 = encode(second)
    assert schema1 == schema2 and values1 != values2  # only the numbers change between checks
    assert extras1 == {} and extras2 == {}  # a healthy check carries no objects
    back = decode(schema2, values2, extras2)
    assert back.scalars == second.scalars and back.overhead_s == second.overhead_s
    assert back.layers == second.layers and back.rank == 5
    for a, b in zip(back.streams, second.streams):
        assert (a.name, a.value, a.layer_number, a.member, a.head, a.limit) == \
            (b.name, b.value, b.layer_number, b.member, b.head, b.limit)
        # The detector sees the same observation as from the original stream and from its name
        # (the reason of a stream within its limit stays behind: the detector reads it beyond only).
        assert stream_observation(a) == dataclasses.replace(stream_observation(b), limit_reason="")
        assert stream_observation(b) == observation(b.name, b.value, b.limit, b.limit_reason)


def test_only_an_alarm_carries_objects():
    payload = _payload(1)
    payload.nonfinite.append(NonFinite(3, "layer 3: non-finite Q/K weights"))
    payload.streams[-1].value = 0.1  # below its limit (a drop family): the reason travels
    schema, values, extras = encode(payload)
    assert extras["nonfinite"] == payload.nonfinite and list(extras["reasons"].values()) == ["value 1"]
    back = decode(schema, values, extras)
    assert back.nonfinite == payload.nonfinite and back.streams[-1].limit_reason == "value 1"
    assert math.isclose(back.streams[-1].value, 0.1)


def test_a_wrong_number_of_values_is_refused():
    schema, values, extras = encode(_payload(1))
    try:
        decode(schema, values[:-1], extras)
    except ValueError as exc:
        assert "rank 5's check records have" in str(exc)
    else:
        raise AssertionError("decode accepted a short row")
