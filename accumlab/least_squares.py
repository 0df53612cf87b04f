"""The least-squares fit both audits explain a gradient with: ``target ≈ Σ x[j] · column[j]``.

The loop audit writes each update's gradient as a combination of per-example
contributions (many columns); the Trainer audit fits one weighting pattern at a time
(one column) and the measured scale (the reference as the column). Both read the same
two numbers: the coefficients and the relative residual.

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
        squared = float(column.dot(column))
        x = float(target.dot(column)) / squared if squared > 0 else 0.0
        return Fit([x], float((target - x * column).norm()) / norm)
    matrix = torch.stack(columns, dim=1)
    x = torch.linalg.lstsq(matrix, target[:, None], driver="gelsd").solution[:, 0]
    return Fit(x.tolist(), float((matrix @ x - target).norm()) / norm)


__all__ = ["Fit", "least_squares"]
