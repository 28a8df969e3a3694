"""The session's records: partial reductions, non-finite reports that carry their layer, keyword-only alerts."""

import math

import pytest
import torch

from mechmon_megatron.session.alert import Alert
from mechmon_megatron.session.attention_check import check_full
from mechmon_megatron.session.host import FullQK
from mechmon_megatron.session.records import NonFinite, Partial, merge_partials


def test_merge_partials_mean_min_value():
    ranks = [
        {"a": Partial("mean", 3.0, 2.0), "m": Partial("min", 5.0), "v": Partial("value", 7.0)},
        {"a": Partial("mean", 5.0, 2.0), "m": Partial("min", 4.0)},
    ]
    assert merge_partials(ranks) == {"a": 2.0, "m": 4.0, "v": 7.0}


def test_partial_is_frozen():
    with pytest.raises(AttributeError):
        Partial("value", 1.0).value = 2.0  # type: ignore[misc]


def test_nonfinite_report_carries_the_layer_number():
    now = FullQK(wq=torch.full((4, 8), math.nan), wk=torch.zeros(4, 8))
    out = check_full(7, FullQK(wq=torch.zeros(4, 8), wk=torch.zeros(4, 8)), now, alpha=2.0)
    assert out.nonfinite == [NonFinite(7, "layer 7: non-finite Q/K weights")]
    assert out.scalars == {} and out.streams == []


def test_alert_takes_keywords_only():
    fields = dict(iteration=3, family="drill", stream="drill", layer=None, head=None, value=0.0,
                  baseline=None, threshold=None, first_warning_step=3)
    assert Alert(**fields).describe().startswith("[mechmon] ALARM at iteration 3: drill job")
    with pytest.raises(TypeError):
        Alert(3, "drill", "drill", None, None, 0.0, None, None, 3)  # type: ignore[misc]
