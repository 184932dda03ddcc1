"""bf16 Gram products on the bf16 units (featcal_kernels/bf16.py): two-term products, the bf16 dual Gram and the
product-form sums, each against a brute-force float64 reference, and when `dual_gram` takes that path."""

from __future__ import annotations

import pytest
import torch

from featcal_kernels import bf16 as bf16_module
from featcal_kernels import dual_gram
from featcal_kernels.bf16 import bf16_target_product, product_terms, weight_groups
from featcal_kernels.gram import bf16_dual_gram

# hi + lo is the fp32-accumulated product to ~2⁻¹⁸ relative; one bf16 product alone is ~2⁻⁹ off.
TWO_TERMS = 1e-5


def bf16_rows(n: int, d: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) + shift).bfloat16()


def pooled_weights(n: int) -> torch.Tensor:
    """The weights a pooled model's last block gives (1 on one token in 50, 0.01 elsewhere), some padding at 0."""
    w = torch.full((n,), 0.01)
    w[::50] = 1.0
    w[-7:] = 0.0
    return w


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def test_two_terms_give_the_product_to_fp32_accuracy_where_one_bf16_product_does_not():
    a, b = bf16_rows(900, 70, 0, 0.5), bf16_rows(900, 40, 1)
    want = a.double().T @ b.double()
    hi, lo = product_terms(a, b)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert rel(hi.double() + lo.double(), want) < TWO_TERMS
    assert rel(hi, want) > 1e-4  # what the second term recovers


def test_weight_groups_split_rows_by_nonzero_value():
    w = torch.tensor([1.0, 0.01, 0.0, 1.0, 0.01, 0.01])
    groups = weight_groups(w)
    assert [v for v, _ in groups] == [pytest.approx(0.01), 1.0]
    assert [rows.tolist() for _, rows in groups] == [[1, 4, 5], [0, 3]]
    assert weight_groups(torch.full((5,), 2.0)) == [(2.0, None)]


@pytest.mark.parametrize("with_xe", [True, False])
def test_bf16_dual_gram_matches_float64_reference(with_xe):
    n, d = 650, 300  # two panels of 256 columns, the second partial
    xs, w = bf16_rows(n, d, 2, 0.5), pooled_weights(n)
    xe = bf16_rows(n, d, 3, -0.25) if with_xe else None
    c_ss, c_se, sum_s, sum_e, sum_w = bf16_dual_gram(xs, xe, w)
    x64, w64 = xs.double(), w.double()
    assert torch.equal(c_ss, c_ss.T)
    assert rel(c_ss, x64.T @ (w64[:, None] * x64)) < TWO_TERMS
    assert rel(sum_s, x64.T @ w64) < TWO_TERMS
    assert float(sum_w) == pytest.approx(float(w64.sum()), rel=1e-6)
    if with_xe:
        assert rel(c_se, x64.T @ (w64[:, None] * xe.double())) < TWO_TERMS
        assert rel(sum_e, xe.double().T @ w64) < TWO_TERMS
    else:
        assert c_se.shape == sum_e.shape == (0,)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_bf16_target_product_matches_float64_reference(alpha):
    n, d_in, d_out = 420, 96, 160
    xs, w = bf16_rows(n, d_in, 4, 0.5), pooled_weights(n)
    w_t = (0.1 * torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(5))).bfloat16()
    y, bias = bf16_rows(n, d_out, 6), 0.3 * torch.randn(d_out, generator=torch.Generator().manual_seed(7))
    pt = bf16_target_product(xs, w, w_t, y, bias, alpha)
    wx = w.double()[:, None] * xs.double()
    target = alpha * (y.double() - bias.double()) + (1 - alpha) * (xs.double() @ w_t.double().T)
    assert rel(pt, wx.T @ target) < TWO_TERMS


def test_dual_gram_takes_the_bf16_units_only_for_bf16_rows_with_few_weight_values(monkeypatch):
    xs, xe, w = bf16_rows(300, 40, 8), bf16_rows(300, 40, 9), pooled_weights(300)
    bf16_path = bf16_dual_gram(xs, xe, w)
    fp32_rows = dual_gram(xs.float(), xe.float(), w)  # what the fp32 path computes from the same values
    monkeypatch.setattr(bf16_module, "cpu_has_native_bf16", lambda: True)
    assert all(torch.equal(a, b) for a, b in zip(dual_gram(xs, xe, w), bf16_path, strict=True))
    many = torch.linspace(0.1, 1.0, 300)  # 300 distinct weights: the fp32 path
    assert all(torch.equal(a, b) for a, b in zip(dual_gram(xs, xe, many), dual_gram(xs.float(), xe.float(), many),
                                                 strict=True))
    monkeypatch.setattr(bf16_module, "cpu_has_native_bf16", lambda: False)
    assert all(torch.equal(a, b) for a, b in zip(dual_gram(xs, xe, w), fp32_rows, strict=True))
