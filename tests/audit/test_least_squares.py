"""The least-squares fit both audits share (accumlab.least_squares), against answers worked
out by hand."""

from __future__ import annotations

import pytest
import torch

from accumlab.least_squares import Fit, least_squares, least_squares_products


def _vectors():
    a = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    b = torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    e = torch.tensor([2.0, 0.0, -1.0, 0.0], dtype=torch.float64)  # orthogonal to a and b
    return a, b, e


def test_an_exact_combination_is_recovered_with_zero_residual():
    a, b, _ = _vectors()
    fit = least_squares(2 * a - 3 * b, [a, b])
    assert fit.coefficients == pytest.approx([2.0, -3.0], abs=1e-12)
    assert fit.residual < 1e-14


def test_the_residual_is_the_part_no_column_explains_over_the_target():
    a, b, e = _vectors()
    target = a + 0.5 * b + e  # |e| = sqrt(5), |target| = sqrt(5 + 0.5 + 5)
    for columns, expected in (([a, b], [1.0, 0.5]), ([a], [1.0])):
        fit = least_squares(target, columns)
        assert fit.coefficients == pytest.approx(expected, abs=1e-12)
    assert least_squares(target, [a, b]).residual == pytest.approx((5 / 10.5) ** 0.5, rel=1e-12)
    # with a alone, 0.5 b is left over too: sqrt(5 + 0.5) / sqrt(10.5)
    assert least_squares(target, [a]).residual == pytest.approx((5.5 / 10.5) ** 0.5, rel=1e-12)


def test_one_column_is_the_projection():
    a, b, _ = _vectors()
    target = 3 * a + b  # <target, a> = 15, <a, a> = 5
    assert least_squares(target, [a]).coefficients == [pytest.approx(3.0, abs=1e-15)]
    assert least_squares(target, [torch.zeros(4, dtype=torch.float64)]) == Fit([0.0], 1.0)


def test_edge_cases_zero_target_no_columns_dependent_columns():
    a, b, _ = _vectors()
    assert least_squares(torch.zeros(4, dtype=torch.float64), [a, b]) == Fit([0.0, 0.0], 0.0)
    assert least_squares(a, []) == Fit([], 1.0)
    fit = least_squares(2 * a, [a, a])  # dependent: the smallest coefficients, 1 and 1
    assert fit.coefficients == pytest.approx([1.0, 1.0], abs=1e-12) and fit.residual < 1e-14


def test_bad_arguments_are_named():
    a, _, _ = _vectors()
    with pytest.raises(TypeError, match="target must be a 1-D floating-point tensor"):
        least_squares(a.reshape(2, 2), [a])
    with pytest.raises(TypeError, match="target"):
        least_squares([1.0, 2.0], [a])
    with pytest.raises(ValueError, match=r"columns\[1\] must be a tensor of the target's shape"):
        least_squares(a, [a, a[:3]])


def test_the_fit_from_inner_products_gives_the_same_answers():
    """least_squares_products (the Trainer audit's form: a model's gradient is too large to
    stack) gives the answers above from <t, t>, <t, c_j> and <c_i, c_j> alone."""
    a, b, e = _vectors()
    target = a + 0.5 * b + e  # <t, t> = 10.5, <t, a> = 5, <t, b> = 1, <a, a> = 5, <b, b> = 2
    fit = least_squares_products(10.5, [5.0, 1.0], [[5.0, 0.0], [0.0, 2.0]])
    assert fit.coefficients == pytest.approx([1.0, 0.5], abs=1e-12)
    assert fit.residual == pytest.approx((5 / 10.5) ** 0.5, rel=1e-12)
    one = least_squares_products(10.5, [5.0], [[5.0]])
    assert one.coefficients == pytest.approx([1.0]) and one.residual == pytest.approx((5.5 / 10.5) ** 0.5)
    assert least_squares_products(10.5, [0.0], [[0.0]]) == Fit([0.0], 1.0)  # a zero column
    assert least_squares_products(0.0, [0.0], [[5.0]]) == Fit([0.0], 0.0)  # a zero target
    assert least_squares_products(5.0, [], []) == Fit([], 1.0)
    dependent = least_squares_products(20.0, [10.0, 10.0], [[5.0, 5.0], [5.0, 5.0]])  # 2a on [a, a]
    assert dependent.coefficients == pytest.approx([1.0, 1.0], abs=1e-12) and dependent.residual < 1e-7
    assert least_squares(target, [a]).coefficients == pytest.approx(one.coefficients, abs=1e-15)
    with pytest.raises(ValueError, match="gram must be 2 x 2"):
        least_squares_products(1.0, [1.0, 2.0], [[1.0]])
