"""The least-squares fit both audits explain a gradient with: ``target ≈ Σ x[j] · column[j]``.

The loop audit writes each update's gradient as a combination of per-example
contributions (many columns); the Trainer audit fits one weighting pattern at a time
(one column) and the measured scale (the reference as the column). Both read the same
two numbers: the coefficients and the relative residual. A whole model's gradient is
held as one tensor per parameter and is too large to stack: :func:`least_squares_products`
is the same fit from the inner products alone (the normal equations), which the caller
accumulates parameter by parameter.

A leaf of the layers: it imports torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Fit:
    """``coefficients[j]`` multiplies ``columns[j]``; ``residual`` is
    ``‖Σ coefficients[j] · columns[j] − target‖ / ‖target‖`` (0 for a zero target, 1 when
    there is no column to explain it with)."""

    coefficients: list[float]
    residual: float


def least_squares(target: Tensor, columns: Sequence[Tensor]) -> Fit:
    """The coefficients that minimise ``‖Σ x[j] · columns[j] − target‖``, and the relative
    residual that is left.

    ``target`` and every column are 1-D tensors of one shape, dtype and device; the fit is
    computed in that dtype (the audits pass float64). A zero target gives zero
    coefficients and residual 0; no columns give residual 1. One column has the closed form
    ``x = <target, column> / <column, column>`` (0 for a zero column), computed without a
    copy of the column; several are stacked and solved by LAPACK's SVD-based ``gelsd``,
    which gives the smallest coefficients when the columns are linearly dependent.
    """
    if not isinstance(target, Tensor) or target.dim() != 1 or not target.is_floating_point():
        raise TypeError(
            "target must be a 1-D floating-point tensor (a flattened gradient), got "
            f"{type(target).__name__}{tuple(getattr(target, 'shape', ()))}"
        )
    columns = list(columns)
    for j, column in enumerate(columns):
        if not isinstance(column, Tensor) or column.shape != target.shape:
            raise ValueError(
                f"columns[{j}] must be a tensor of the target's shape {tuple(target.shape)}, "
                f"got {type(column).__name__}{tuple(getattr(column, 'shape', ()))}"
            )
    norm = float(target.norm())
    if norm == 0.0:
        return Fit([0.0] * len(columns), 0.0)
    if not columns:
        return Fit([], 1.0)
    if len(columns) == 1:
        (column,) = columns
        (x,) = least_squares_products(norm * norm, [float(target.dot(column))],
                                      [[float(column.dot(column))]]).coefficients
        return Fit([x], float((target - x * column).norm()) / norm)
    matrix = torch.stack(columns, dim=1)
    x = torch.linalg.lstsq(matrix, target[:, None], driver="gelsd").solution[:, 0]
    return Fit(x.tolist(), float((matrix @ x - target).norm()) / norm)


def least_squares_products(
    target_norm2: float, target_dots: Sequence[float], gram: Sequence[Sequence[float]]
) -> Fit:
    """The fit of :func:`least_squares` from inner products: ``target_norm2`` is
    ``<target, target>``, ``target_dots[j]`` is ``<target, column_j>``, ``gram[i][j]`` is
    ``<column_i, column_j>`` (floats, accumulated in float64 by the caller).

    Solves the normal equations ``gram · x = target_dots`` (the smallest solution when the
    columns are dependent; a zero column gets coefficient 0); the residual is
    ``sqrt(max(<t, t> − x · target_dots, 0)) / ‖t‖``, which loses digits below about 1e-7
    relative (the difference of two nearly equal squares): enough to tell which pattern
    explains a gradient, not to measure a float32 rounding error (form that difference
    entry by entry).
    """
    k = len(target_dots)
    if len(gram) != k or any(len(row) != k for row in gram):
        raise ValueError(f"gram must be {k} x {k} (one row and column per column), got {gram!r}")
    if not target_norm2 > 0:
        return Fit([0.0] * k, 0.0)
    if k == 0:
        return Fit([], 1.0)
    if k == 1:
        squared = float(gram[0][0])
        x = [float(target_dots[0]) / squared if squared > 0 else 0.0]
    else:
        matrix = torch.tensor(gram, dtype=torch.float64)
        rhs = torch.tensor(target_dots, dtype=torch.float64)[:, None]
        x = torch.linalg.lstsq(matrix, rhs, driver="gelsd").solution[:, 0].tolist()
    explained = sum(a * b for a, b in zip(x, target_dots, strict=True))
    return Fit(x, (max(target_norm2 - explained, 0.0) / target_norm2) ** 0.5)


__all__ = ["Fit", "least_squares", "least_squares_products"]
