"""The fit of per-example shares: each example's correct contribution (its summed
next-token loss over its window's target count, differentiated at the weights its forward
pass ran at), the least-squares fit of the gradient each ``optimizer.step`` found as a
combination of them, and the weightings (what each loss sum is divided by) a loop can
give a window's examples, each with the mistakes it stands for."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..least_squares import least_squares
from ..objectives import NextTokenLoss
from .controlled_set import _TOL, RowKey, _Row
from .watch import _flat_grad, _Watch


@dataclass(frozen=True)
class _Weighting:
    """A way to weight a window's examples: what each loss sum is divided by."""

    key: str
    mistakes: tuple[str, ...]
    note: str | None = None
    unit: str = "targets"  # what it counts (a key of _UNITS)


#: What a loop can count as its denominator: the ``_Row`` attribute, and the mistakes that
#: counting it instead of the targets stands for.
_UNITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "targets": ("targets", ()),
    "label positions": ("positions", ("ignored_tokens_counted",)),
    "attention-mask tokens": ("mask", ("ignored_tokens_counted",)),
    "attention-mask tokens after the shift": ("mask_shifted", ("ignored_tokens_counted",)),
    "labels before the shift": ("labels", ("count_before_shift",)),
}
#: Per-example means averaged over the window's examples.
PER_EXAMPLE = "targets in the example × examples in the window"
#: Per-microbatch means, each weighted by its share of the window's examples.
MEAN_BY_EXAMPLES = "targets in the microbatch × examples in the window / examples in the microbatch"


def _weightings(
    rows: Sequence[_Row], keep: Sequence[bool] | None = None
) -> list[tuple[_Weighting, list[float]]]:
    """Each candidate weighting with the divisor it gives every example (row) of a window.

    The right one divides every loss sum by the window's targets. The others are the
    mistakes: an extra ``/ A`` (double division), per-microbatch or per-example means
    averaged (average of averages, also with each microbatch's mean weighted by its
    examples), counts that include ignored positions (label positions, mask tokens before
    or after the shift), the count of labels before the shift, and combinations. With
    ``keep``, the window is the kept rows only (a loop that lost some and normalizes over
    what it trained); the other rows get an infinite divisor.
    """
    keep = [True] * len(rows) if keep is None else list(keep)
    kept = [row for row, k in zip(rows, keep, strict=True) if k]
    microbatches = sorted({row.microbatch for row in kept})
    a, n_examples = len(microbatches), len(kept)

    def per_row(values: Callable[[_Row], float]) -> list[float]:
        return [
            float(values(row)) if k else float("inf") for row, k in zip(rows, keep, strict=True)
        ]

    out: list[tuple[_Weighting, list[float]]] = [
        (
            _Weighting(
                "nothing",
                (),
                "the loss sums are not divided at all: every update is "
                "as many times too large as the window has targets",
            ),
            per_row(lambda row: 1.0),
        )
    ]
    for unit, (attr, ignored) in _UNITS.items():
        total = sum(getattr(row, attr) for row in kept)
        in_mb = {
            i: sum(getattr(row, attr) for row in kept if row.microbatch == i) for i in microbatches
        }
        out.append(
            (
                _Weighting(f"{unit} in the window", ignored, unit=unit),
                per_row(lambda row, total=total: total),
            )
        )
        out.append(
            (
                _Weighting(f"A × {unit} in the window", (*ignored, "double_division"), unit=unit),
                per_row(lambda row, total=total: a * total),
            )
        )
        if a == 1:
            continue  # one microbatch: per-microbatch and per-window weightings coincide
        aoa = ("average_of_averages", *ignored)
        out.append(
            (
                _Weighting(
                    f"{unit} in the microbatch",
                    aoa,
                    "the microbatch means are added without dividing by A: every update is "
                    "A times too large",
                    unit=unit,
                ),
                per_row(lambda row, in_mb=in_mb: in_mb[row.microbatch]),
            )
        )
        out.append(
            (
                _Weighting(f"A × {unit} in the microbatch", aoa, unit=unit),
                per_row(lambda row, in_mb=in_mb: a * in_mb[row.microbatch]),
            )
        )
        out.append(
            (
                _Weighting(f"A² × {unit} in the microbatch", (*aoa, "double_division"), unit=unit),
                per_row(lambda row, in_mb=in_mb: a * a * in_mb[row.microbatch]),
            )
        )
    if n_examples > a:  # else per-example means are the per-microbatch ones
        out.append(
            (
                _Weighting(PER_EXAMPLE, ("average_of_averages",)),
                per_row(lambda row: row.targets * n_examples),
            )
        )
    examples = {i: sum(row.microbatch == i for row in kept) for i in microbatches}
    if len(set(examples.values())) > 1:  # else it is A × targets in the microbatch
        targets = {i: sum(r.targets for r in kept if r.microbatch == i) for i in microbatches}
        out.append(
            (
                _Weighting(MEAN_BY_EXAMPLES, ("average_of_averages",)),
                per_row(
                    lambda row: targets[row.microbatch] * n_examples / examples[row.microbatch]
                ),
            )
        )
    return out


def _near(x: float, y: float) -> bool:
    return abs(x - y) <= _TOL * max(abs(x), abs(y), 1e-12)


@dataclass
class _Fit:
    weights: list[float]  # per example of the window
    carried: float
    residual: float


class _Shares:
    """The correct per-example contributions of the watched run, and each update written
    as a combination of them (the shares)."""

    def __init__(
        self,
        watch: _Watch,
        windows: list[list[dict[str, Tensor]]],
        rows: list[list[_Row]],
        starts: list[int],
        final: Tensor,
        reference: nn.Module,
    ) -> None:
        self.watch, self.windows, self.rows, self.starts = watch, windows, rows, starts
        self.final, self.reference = final, reference
        objective = NextTokenLoss()
        self.totals = [sum(objective.count(mb) for mb in w) for w in windows]
        self.by_key = {row.key: row for window in rows for row in window}
        self._cache: dict[tuple[RowKey, int, int], Tensor] = {}
        self.late: set[RowKey] = set()  # examples trained after their window's last step

    def contribution(self, key: RowKey, theta: int, shift: int = 1) -> Tensor:
        """One example's loss sum over its window's targets, differentiated at weights
        ``thetas[theta]``, with position ``t`` predicting ``labels[t + shift]``."""
        if (key, theta, shift) not in self._cache:
            k, i, r = key
            n = self.by_key[key].tokens.numel()
            mb = self.windows[k][i]
            torch.nn.utils.vector_to_parameters(
                self.watch.thetas[theta], self.reference.parameters()
            )
            self.reference.zero_grad(set_to_none=True)
            logits = self.reference(mb["input_ids"][r : r + 1, :n]).logits[0]
            part = F.cross_entropy(
                logits[: n - shift], mb["labels"][r, shift:n], ignore_index=-100, reduction="sum"
            )
            (part / self.totals[k]).backward()
            self._cache[(key, theta, shift)] = _flat_grad(list(self.reference.parameters()))
        return self._cache[(key, theta, shift)]

    def _columns(self, k: int) -> list[tuple[RowKey, int]]:
        """The (example, weights) pairs that can have reached window ``k``'s steps: every
        trained forward pass of this window and the earlier ones, each pair once."""
        seen: dict[tuple[RowKey, int], None] = {}
        for f in self.watch.forwards:
            if f.window <= k and f.backward:
                for key in f.rows:
                    if key is not None:
                        seen[(key, f.theta)] = None
        return list(seen)

    def _fit_window(self, k: int, steps: list[int], shift: int) -> _Fit:
        columns = self._columns(k)
        index = {row.key: j for j, row in enumerate(self.rows[k])}
        basis = [self.contribution(key, theta, shift) for key, theta in columns]
        weights = [0.0] * len(self.rows[k])
        carried, residual = 0.0, 0.0
        for s in steps:
            fit = least_squares(self.watch.steps[s].grad, basis)
            residual = max(residual, fit.residual)
            for (key, _), x in zip(columns, fit.coefficients, strict=True):
                if key[0] == k:
                    weights[index[key]] += x
                else:
                    carried = max(carried, abs(x))
        return _Fit(weights, carried, residual)

    @staticmethod
    def _nested(rows: Sequence[_Row], values: Sequence[Any], a: int) -> list[list[Any]]:
        out: list[list[Any]] = [[] for _ in range(a)]
        for row, v in zip(rows, values, strict=True):
            out[row.microbatch].append(v)
        return out

    @staticmethod
    def _per_microbatch(rows: Sequence[_Row], weights: Sequence[float], a: int) -> list[float]:
        """Each microbatch's share: the target-weighted mean of its examples' shares."""
        num, den = [0.0] * a, [0] * a
        for row, w in zip(rows, weights, strict=True):
            num[row.microbatch] += w * row.targets
            den[row.microbatch] += row.targets
        return [round(x / d, 12) if d else 0.0 for x, d in zip(num, den, strict=True)]

    def _matching(
        self, k: int, weights: list[float], trained: list[int], used: list[int], lost: list[int]
    ) -> dict[str, tuple[_Weighting, list[float]]]:
        """The weightings window ``k``'s example shares agree with (each trained example
        counted as often as it was trained), over the whole window and, when examples
        were lost, over the examples the loop trained."""
        total = self.totals[k]
        rows = self.rows[k]
        options = _weightings(rows)
        if lost:
            options += _weightings(rows, [t > 0 for t in trained])
        out: dict[str, tuple[_Weighting, list[float]]] = {}
        for w, d in options:
            if w.key not in out and all(
                _near(weights[j], max(1, trained[j]) * total / d[j]) for j in used
            ):
                out[w.key] = (w, d)
        return out


def _choose_weighting(
    matches: list[dict[str, tuple[_Weighting, list[float]]] | None],
) -> _Weighting | None:
    """The weighting every analysed window agrees with (the simplest if several do)."""
    sets = [m for m in matches if m is not None]
    if not sets:
        return None
    common = set.intersection(*(set(m) for m in sets))
    if not common:
        return None
    options = [sets[0][key][0] for key in common]
    return min(options, key=lambda w: (len(w.mistakes), w.note is not None, w.key))
