"""The session's records: partial reductions, non-finite reports that carry their layer, keyword-only alerts."""

import math

import pytest
import torch

from mechmon_megatron.session import names
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


def test_randomized_full_matrix_check_equals_exact_when_the_sketch_spans_the_matrix():
    """Default randomized spectrum: exact (up to round-off) once rank >= min(m, n),
    i.e. at the example trainer's shapes; a certified truncation at frontier shapes."""
    g = torch.Generator().manual_seed(0)
    prev = FullQK(wq=torch.randn(64, 48, generator=g), wk=torch.randn(32, 48, generator=g))
    now = FullQK(wq=prev.wq + 1e-2 * torch.randn(64, 48, generator=g),
                 wk=prev.wk + 1e-2 * torch.randn(32, 48, generator=g))
    exact = check_full(3, prev, now, alpha=2.0, method="exact", norm_iters=0)
    fast = check_full(3, prev, now, alpha=2.0, method="randomized", rank=48, norm_iters=0)
    for key, part in exact.scalars.items():
        assert fast.scalars[key].value == pytest.approx(part.value, rel=1e-9), key
    truncated = check_full(3, prev, now, alpha=2.0, method="randomized", rank=8)
    assert truncated.scalars[names.attn("dw_fro_norm", 3)].value == pytest.approx(
        exact.scalars[names.attn("dw_fro_norm", 3)].value, rel=1e-12)  # the Frobenius norm stays exact
