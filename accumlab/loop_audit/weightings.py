"""The weightings a loop can give a window's examples (what each loss sum is divided by),
each with the mistakes it stands for, and which of them measured shares agree with."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .controlled_set import AUDIT_TOLERANCE, Row


@dataclass(frozen=True)
class Weighting:
    """A way to weight a window's examples: what each loss sum is divided by."""

    key: str
    mistakes: tuple[str, ...]
    note: str | None = None
    unit: str = "targets"  # what it counts (a key of UNITS)


#: What a loop can count as its denominator: the ``Row`` attribute, and the mistakes that
#: counting it instead of the targets stands for.
UNITS: dict[str, tuple[str, tuple[str, ...]]] = {
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
#: Per-microbatch means over the A of a full window, also in a shorter window (Lightning's
#: and Accelerate's division by the configured A, whatever the window holds).
FULL_A_MEAN = "the full A × targets in the microbatch"
#: torchtune's single-device recipe: each microbatch's mean times its labels counted before
#: the shift, the window scaled by one over that count summed.
MEAN_TIMES_LABELS = (
    "targets in the microbatch × labels before the shift in the window / labels before the "
    "shift in the microbatch"
)

Matches = dict[str, tuple[Weighting, list[float]]]


def near(x: float, y: float) -> bool:
    """``x`` equals ``y`` within :data:`AUDIT_TOLERANCE` (relative)."""
    return abs(x - y) <= AUDIT_TOLERANCE * max(abs(x), abs(y), 1e-12)


def weightings(
    rows: Sequence[Row], keep: Sequence[bool] | None = None, full_a: int | None = None
) -> list[tuple[Weighting, list[float]]]:
    """Each candidate weighting with the divisor it gives every example (row) of a window.

    The right one divides every loss sum by the window's targets. The others are the
    mistakes: an extra ``/ A`` (double division), per-microbatch or per-example means
    averaged (average of averages, also with each microbatch's mean weighted by its
    examples, or divided by ``full_a``, the A of a full window, in a shorter one too: the
    short window divided by the full A), counts that include ignored positions (label
    positions, mask tokens before or after the shift), the count of labels before the
    shift (as the window's divisor, or as torchtune's factor on each microbatch's mean),
    and combinations. With ``keep``, the window is the kept rows only (a loop that lost some
    and normalizes over what it trained); the other rows get an infinite divisor.
    """
    keep = [True] * len(rows) if keep is None else list(keep)
    kept = [row for row, k in zip(rows, keep, strict=True) if k]
    microbatches = sorted({row.microbatch for row in kept})
    a, n_examples = len(microbatches), len(kept)

    def per_row(values: Callable[[Row], float]) -> list[float]:
        return [
            float(values(row)) if k else float("inf") for row, k in zip(rows, keep, strict=True)
        ]

    out: list[tuple[Weighting, list[float]]] = [
        (
            Weighting(
                "nothing",
                (),
                "the loss sums are not divided at all: every update is "
                "as many times too large as the window has targets",
            ),
            per_row(lambda row: 1.0),
        )
    ]
    for unit, (attr, ignored) in UNITS.items():
        total = sum(getattr(row, attr) for row in kept)
        in_mb = {
            i: sum(getattr(row, attr) for row in kept if row.microbatch == i) for i in microbatches
        }
        out.append(
            (
                Weighting(f"{unit} in the window", ignored, unit=unit),
                per_row(lambda row, total=total: total),
            )
        )
        out.append(
            (
                Weighting(f"A × {unit} in the window", (*ignored, "double_division"), unit=unit),
                per_row(lambda row, total=total: a * total),
            )
        )
        if a == 1:
            continue  # one microbatch: per-microbatch and per-window weightings coincide
        aoa = ("average_of_averages", *ignored)
        out.append(
            (
                Weighting(
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
                Weighting(f"A × {unit} in the microbatch", aoa, unit=unit),
                per_row(lambda row, in_mb=in_mb: a * in_mb[row.microbatch]),
            )
        )
        out.append(
            (
                Weighting(f"A² × {unit} in the microbatch", (*aoa, "double_division"), unit=unit),
                per_row(lambda row, in_mb=in_mb: a * a * in_mb[row.microbatch]),
            )
        )
    if a > 1:  # one microbatch: its mean times its count over that count is the mean
        labels = sum(row.labels for row in kept)
        labels_in = {i: sum(r.labels for r in kept if r.microbatch == i) for i in microbatches}
        targets_in = {i: sum(r.targets for r in kept if r.microbatch == i) for i in microbatches}
        out.append(
            (
                Weighting(MEAN_TIMES_LABELS, ("count_before_shift",), unit="labels before the shift"),
                per_row(
                    lambda row: targets_in[row.microbatch] * labels / labels_in[row.microbatch]
                ),
            )
        )
    if full_a is not None and a > 1:  # in a full window it is A × targets in the microbatch
        targets_in = {i: sum(r.targets for r in kept if r.microbatch == i) for i in microbatches}
        out.append(
            (
                Weighting(FULL_A_MEAN, ("average_of_averages", "short_window_divided_by_a")),
                per_row(lambda row: full_a * targets_in[row.microbatch]),
            )
        )
    if n_examples > a:  # else per-example means are the per-microbatch ones
        out.append(
            (
                Weighting(PER_EXAMPLE, ("average_of_averages",)),
                per_row(lambda row: row.targets * n_examples),
            )
        )
    examples = {i: sum(row.microbatch == i for row in kept) for i in microbatches}
    if len(set(examples.values())) > 1:  # else it is A × targets in the microbatch
        targets = {i: sum(r.targets for r in kept if r.microbatch == i) for i in microbatches}
        out.append(
            (
                Weighting(MEAN_BY_EXAMPLES, ("average_of_averages",)),
                per_row(
                    lambda row: targets[row.microbatch] * n_examples / examples[row.microbatch]
                ),
            )
        )
    return out


def matching(
    rows: Sequence[Row],
    total: int,
    weights: Sequence[float],
    trained: Sequence[int],
    used: Sequence[int],
    lost: bool,
    full_a: int | None = None,
) -> Matches:
    """The weightings a window's example shares (``weights``) agree with on the ``used``
    examples, each trained example counted as often as it was trained (``trained``), over
    the whole window of ``total`` targets and, when examples were ``lost``, over the
    examples the loop trained; ``full_a`` is the A of the audit's full windows."""
    options = weightings(rows, full_a=full_a)
    if lost:
        options += weightings(rows, [t > 0 for t in trained], full_a)
    out: Matches = {}
    for w, d in options:
        if w.key not in out and all(
            near(weights[j], max(1, trained[j]) * total / d[j]) for j in used
        ):
            out[w.key] = (w, d)
    return out


def choose_weighting(matches: Sequence[Matches | None]) -> Weighting | None:
    """The weighting every analysed window agrees with (the simplest if several do)."""
    sets = [m for m in matches if m is not None]
    if not sets:
        return None
    common = set.intersection(*(set(m) for m in sets))
    if not common:
        return None
    options = [sets[0][key][0] for key in common]
    return min(options, key=lambda w: (len(w.mistakes), w.note is not None, w.key))
