"""The shares: each update the loop made, written as a combination of the correct
per-example contributions (:mod:`.contributions`) by the shared least-squares fit.

An example's share is 1 in a correct loop, ``1/A`` under a double division, 0 for an
example never trained, 2 for one trained twice; :mod:`.weightings` names the pattern.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..least_squares import least_squares
from .contributions import Contributions
from .controlled_set import Row, RowKey
from .trace import UpdateTrace


@dataclass
class Shares:
    """Window ``k``'s updates as a combination of contributions.

    ``weights[j]``: the share of the window's example ``j`` (its rows in order), summed
    over the window's optimizer steps; ``carried``: the largest share of an earlier
    window's example; ``residual``: the largest relative residual over the steps (what no
    combination of contributions explains).
    """

    weights: list[float]
    carried: float
    residual: float


def _columns(trace: UpdateTrace, k: int) -> list[tuple[RowKey, int]]:
    """The (example, weights) pairs that can have reached window ``k``'s steps: every
    trained forward pass of this window and the earlier ones, each pair once."""
    seen: dict[tuple[RowKey, int], None] = {}
    for f in trace.forwards:
        if f.window <= k and f.backward:
            for key in f.rows:
                if key is not None:
                    seen[(key, f.theta)] = None
    return list(seen)


def fit_shares(
    trace: UpdateTrace,
    contributions: Contributions,
    rows: Sequence[Row],
    k: int,
    steps: Sequence[int],
    shift: int,
) -> Shares:
    """Fit the gradient of each of window ``k``'s ``steps`` (indices into ``trace.steps``)
    with the contributions at label shift ``shift``."""
    columns = _columns(trace, k)
    index = {row.key: j for j, row in enumerate(rows)}
    basis = [contributions.of(key, theta, shift) for key, theta in columns]
    weights = [0.0] * len(rows)
    carried, residual = 0.0, 0.0
    for s in steps:
        fit = least_squares(trace.steps[s].grad, basis)
        residual = max(residual, fit.residual)
        for (key, _), x in zip(columns, fit.coefficients, strict=True):
            if key[0] == k:
                weights[index[key]] += x
            else:
                carried = max(carried, abs(x))
    return Shares(weights, carried, residual)


def nested(rows: Sequence[Row], values: Sequence[Any], a: int) -> list[list[Any]]:
    """Per-example ``values`` grouped by microbatch: ``out[i][r]`` for row ``r`` of ``i``."""
    out: list[list[Any]] = [[] for _ in range(a)]
    for row, v in zip(rows, values, strict=True):
        out[row.microbatch].append(v)
    return out


def per_microbatch(rows: Sequence[Row], weights: Sequence[float], a: int) -> list[float]:
    """Each microbatch's share: the target-weighted mean of its examples' shares."""
    num, den = [0.0] * a, [0] * a
    for row, w in zip(rows, weights, strict=True):
        num[row.microbatch] += w * row.targets
        den[row.microbatch] += row.targets
    return [round(x / d, 12) if d else 0.0 for x, d in zip(num, den, strict=True)]
