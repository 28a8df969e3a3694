"""The family table (``detect/families.py``): one declaration that the detector and the rest read."""

from __future__ import annotations

from typing import get_args

import pytest

from mechmon_megatron.detect.families import (
    FAMILIES,
    FAMILY_BY_NAME,
    FAMILY_NAMES,
    FamilyName,
    FamilySpec,
    Monitor,
    family_spec,
)
from mechmon_megatron.detect.pooled_cusum import FAMILY_DIRECTIONS, OPTIONAL_FAMILIES
from mechmon_megatron.detect.robust_trend import Direction


def test_the_literal_type_names_the_table_in_its_order():
    assert get_args(FamilyName) == FAMILY_NAMES == tuple(s.name for s in FAMILIES)
    assert len(set(FAMILY_NAMES)) == len(FAMILIES)
    assert dict(FAMILY_BY_NAME) == {s.name: s for s in FAMILIES}


@pytest.mark.parametrize("spec", FAMILIES, ids=FAMILY_NAMES)
def test_every_row_is_complete(spec: FamilySpec):
    assert spec.direction in get_args(Direction) and spec.monitor in get_args(Monitor)
    assert spec.scalars and all(s and "/" not in s for s in spec.scalars)
    assert spec.label and spec.no_signal
    assert not spec.optional or spec.switch is not None  # an optional family is asked for by its switch
    assert "--mechmon" not in spec.no_signal  # settings are $field placeholders, spelled by whoever shows them
    assert spec.name.startswith(f"{spec.monitor}_")  # the names say their monitor


def test_the_detectors_public_names_are_reads_of_the_table():
    assert dict(FAMILY_DIRECTIONS) == {s.name: s.direction for s in FAMILIES}
    assert list(FAMILY_DIRECTIONS) == list(FAMILY_NAMES)
    assert OPTIONAL_FAMILIES == tuple(s.name for s in FAMILIES if s.optional)
    with pytest.raises(TypeError):
        FAMILY_DIRECTIONS["attn_dw"] = "rise"  # type: ignore[index]


def test_rows_are_frozen_and_lookup_names_the_known_families():
    with pytest.raises(AttributeError):
        FAMILIES[0].direction = "rise"  # type: ignore[misc]
    assert family_spec("attn_dw") is FAMILY_BY_NAME["attn_dw"]
    with pytest.raises(ValueError, match=r"unknown detector family 'attn_delta3'; known: \['attn_delta2'"):
        family_spec("attn_delta3")
