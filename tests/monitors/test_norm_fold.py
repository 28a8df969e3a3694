"""``fold_norm``: a QK-norm's gamma (shared or one row per head) and LayerNorm centring folded
into per-head Q/K rows, in float64."""

from __future__ import annotations

import pytest
import torch

from mechmon_megatron.monitors.norm_fold import NormFold, fold_norm


def _rows(heads=3, head_dim=4, hidden=5) -> torch.Tensor:
    return torch.randn(heads, head_dim, hidden, dtype=torch.float32)


def test_identity_fold_returns_the_rows_themselves():
    rows = _rows()
    assert fold_norm(rows, None) is rows and fold_norm(rows, NormFold()) is rows


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("centres", [False, True])
def test_fold_is_diag_gamma_times_centred_rows_in_float64(per_head, centres):
    rows = _rows()
    gamma = torch.rand(3, 4) + 0.5 if per_head else torch.rand(4) + 0.5
    got = fold_norm(rows, NormFold(gamma=gamma, centres=centres))
    x = rows.double()
    if centres:
        x = x - x.mean(dim=1, keepdim=True)
    g = gamma.double() if per_head else gamma.double().expand(3, 4)
    expected = torch.stack([torch.diag(g[h]) @ x[h] for h in range(3)])
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-15, atol=0)


def test_product_of_float32_numbers_is_exact_in_float64():
    rows, gamma = _rows(), torch.rand(4) + 0.5
    got = fold_norm(rows, NormFold(gamma=gamma))
    exact = rows.double() * gamma.double()[:, None]
    assert torch.equal(got, exact)  # no rounding: 24 + 24 bits fit in 53


def test_wrong_gamma_size_names_both_expected_shapes():
    with pytest.raises(ValueError, match="expected 4 .* or 3 x 4"):
        fold_norm(_rows(), NormFold(gamma=torch.ones(5)))
