"""Plotting helpers for the notebooks, each a thin matplotlib layer over a pure function.

The pure functions (``curve_points``, ``weight_bars``, ``run_curve``) check and arrange
the numbers; the ``plot_*`` functions draw them on an Axes and return it, so a notebook
can add to the figure and a test can read the drawn data back under the Agg backend
without a display. Every helper draws on ``ax`` (or ``axes``) when given, else on a new
figure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def _numbers(name: str, values: object) -> list[float]:
    """``values`` as a list of floats, or a TypeError naming ``name``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name} must be a sequence of numbers (list, tuple), got {type(values).__name__}"
        )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(
                f"{name}[{i}] must be a number, got {type(v).__name__} ({v!r}); convert "
                "tensors with float(t) or t.tolist()"
            )
        out.append(float(v))
    return out


def _axes(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(6.4, 3.6))
    return ax


def curve_points(
    curves: Mapping[str, Sequence[float]], x: Sequence[float] | None = None
) -> dict[str, tuple[list[float], list[float]]]:
    """Check ``curves`` and pair every series with its x values.

    ``curves`` maps a label to its y values (NaN is allowed and drawn as a gap, e.g. a
    diverged run). ``x`` gives the shared x values (for instance applied updates or
    examples seen); by default the i-th value sits at x = i. Every series must have as
    many values as ``x``. Returns ``{label: (xs, ys)}`` as lists of floats, in the order
    of ``curves``.
    """
    if not isinstance(curves, Mapping):
        raise TypeError(
            f"curves must be a mapping from label to values, got {type(curves).__name__}; "
            "e.g. {'token mean': [...], 'average of averages': [...]}"
        )
    if not curves:
        raise ValueError("curves is empty: pass at least one labelled series")
    shared_x = None if x is None else _numbers("x", x)
    points = {}
    for label, values in curves.items():
        ys = _numbers(f"curves[{label!r}]", values)
        if not ys:
            raise ValueError(f"curves[{label!r}] is empty: a curve needs at least one value")
        xs = list(map(float, range(len(ys)))) if shared_x is None else shared_x
        if len(xs) != len(ys):
            raise ValueError(
                f"curves[{label!r}] has {len(ys)} values but x has {len(xs)}; give one x "
                "per value"
            )
        points[str(label)] = (list(xs), ys)
    return points


def plot_loss_curves(
    curves: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    x: Sequence[float] | None = None,
    title: str | None = None,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Draw one line per labelled series (see :func:`curve_points`) and return the Axes.

    Name the units in the labels, e.g. ``xlabel="applied updates"``,
    ``ylabel="token-mean loss (nats)"``. ``styles`` maps a label to keyword arguments
    for its line (``{"color": "C0", "linestyle": "--"}``); every key must be a label of
    ``curves``. A legend lists the series in the order given.
    """
    points = curve_points(curves, x)
    styles = dict(styles or {})
    unknown = sorted(set(styles) - set(points))
    if unknown:
        raise ValueError(f"styles names {unknown}, which are not labels of curves {list(points)}")
    ax = _axes(ax)
    for label, (xs, ys) in points.items():
        style = {"marker": "." if len(ys) <= 30 else None, **styles.get(label, {})}
        ax.plot(xs, ys, label=label, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


@dataclass(frozen=True)
class BarGroup:
    """One scheme's bars in a grouped bar chart: centres, heights and the bar width."""

    label: str
    positions: list[float]
    heights: list[float]
    width: float


def weight_bars(
    weights: Mapping[str, Sequence[float]], *, group_width: float = 0.8
) -> list[BarGroup]:
    """Lay out a grouped bar chart: one group per microbatch, one bar per scheme.

    ``weights`` maps a scheme name to one value per microbatch (for instance each
    microbatch's share of the window's loss, so a scheme's values add up to 1); every
    scheme needs the same number of microbatches, at least one. Group ``i`` is centred on
    x = i and its bars share ``group_width`` (0 < group_width <= 1). Values must be finite.
    """
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(
            "weights must be a non-empty mapping from scheme name to per-microbatch values, "
            f"got {weights!r}"
        )
    if not 0 < group_width <= 1:
        raise ValueError(f"group_width must be in (0, 1], got {group_width!r}")
    series = {str(k): _numbers(f"weights[{k!r}]", v) for k, v in weights.items()}
    lengths = {len(v) for v in series.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            "every scheme in weights needs the same, non-zero number of microbatches; got "
            + ", ".join(f"{k}: {len(v)}" for k, v in series.items())
        )
    for name, values in series.items():
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"weights[{name!r}] holds a non-finite value: {values}")
    width = group_width / len(series)
    groups = []
    for j, (name, values) in enumerate(series.items()):
        offset = -group_width / 2 + width * (j + 0.5)
        groups.append(BarGroup(name, [i + offset for i in range(len(values))], values, width))
    return groups


def plot_weights(
    weights: Mapping[str, Sequence[float]],
    *,
    labels: Sequence[str] | None = None,
    xlabel: str = "microbatch",
    ylabel: str = "share of the window",
    title: str | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Grouped bars of per-microbatch weights under each scheme (see :func:`weight_bars`).

    ``labels`` names the microbatches on the x axis (default ``"0"``, ``"1"``, ...). The
    bars of each scheme form one container in ``ax.containers``, in the order given.
    """
    groups = weight_bars(weights)
    n = len(groups[0].heights)
    if labels is not None and len(labels) != n:
        raise ValueError(f"labels has {len(labels)} names but there are {n} microbatches")
    ax = _axes(ax)
    for group in groups:
        ax.bar(group.positions, group.heights, width=group.width, label=group.label)
    ax.set_xticks(range(n))
    ax.set_xticklabels([str(i) for i in range(n)] if labels is None else list(labels))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return ax


@dataclass(frozen=True)
class RunCurve:
    """One run's measurements and where it was when it took each one.

    ``values[i]`` was measured after ``updates[i]`` applied updates, when the run had
    seen ``seen[i]`` examples (or tokens: name the unit in the plot). The counts never
    decrease. Two runs with different effective batches reach the same ``seen`` after
    different numbers of updates, which is why they are compared on the ``seen`` axis.
    """

    values: list[float]
    updates: list[float]
    seen: list[float]


def run_curve(
    values: Sequence[float], *, updates: Sequence[float], seen: Sequence[float]
) -> RunCurve:
    """Check and build a :class:`RunCurve`: three equally long, non-empty sequences of
    numbers; ``updates`` and ``seen`` non-decreasing and non-negative (``values`` may hold
    NaN, drawn as a gap)."""
    curve = RunCurve(
        _numbers("values", values), _numbers("updates", updates), _numbers("seen", seen)
    )
    n = len(curve.values)
    if n == 0:
        raise ValueError("values is empty: a curve needs at least one measurement")
    for name in ("updates", "seen"):
        xs = getattr(curve, name)
        if len(xs) != n:
            raise ValueError(f"{name} has {len(xs)} values but values has {n}; give one per value")
        if any(not math.isfinite(v) or v < 0 for v in xs):
            raise ValueError(f"{name} must hold finite counts >= 0, got {xs}")
        if any(b < a for a, b in zip(xs, xs[1:], strict=False)):
            raise ValueError(f"{name} must never decrease (it counts what the run did), got {xs}")
    return curve


def plot_updates_and_examples(
    runs: Mapping[str, RunCurve],
    *,
    ylabel: str,
    seen_label: str = "examples seen",
    axes: Sequence[Axes] | None = None,
) -> tuple[Axes, Axes]:
    """Draw every run twice: against applied updates (left) and against ``seen`` (right).

    ``runs`` maps a label to a :class:`RunCurve` (see :func:`run_curve`). ``axes`` is an
    optional pair of Axes to draw on; by default a new figure with two panels sharing the
    y axis. Each run keeps its colour in both panels. Returns ``(by_updates, by_seen)``.
    """
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(f"runs must be a non-empty mapping from label to RunCurve, got {runs!r}")
    for label, curve in runs.items():
        if not isinstance(curve, RunCurve):
            raise TypeError(
                f"runs[{label!r}] must be a RunCurve (build it with run_curve), got "
                f"{type(curve).__name__}"
            )
    if axes is None:
        import matplotlib.pyplot as plt

        _, pair = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
        by_updates, by_seen = pair
    else:
        if len(axes) != 2:
            raise ValueError(f"axes must be a pair of Axes, got {len(axes)}")
        by_updates, by_seen = axes
    for i, (label, curve) in enumerate(runs.items()):
        style = {"color": f"C{i}", "marker": "." if len(curve.values) <= 30 else None}
        by_updates.plot(curve.updates, curve.values, label=str(label), **style)
        by_seen.plot(curve.seen, curve.values, label=str(label), **style)
    for ax, xlabel in ((by_updates, "applied updates"), (by_seen, seen_label)):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend()
    by_updates.set_ylabel(ylabel)
    by_updates.set_title("on the update axis")
    by_seen.set_title(f"on the {seen_label} axis")
    return by_updates, by_seen
