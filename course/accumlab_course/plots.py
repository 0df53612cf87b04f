"""Plotting helpers for the notebooks, each a thin matplotlib layer over a pure function.

The pure functions (``curve_points``, ``weight_bars``, ``run_curve``) check and arrange
the numbers; the ``plot_*`` functions draw them on an Axes and return it, so a notebook
can add to the figure and a test can read the drawn data back under the Agg backend
without a display. Every helper draws on ``ax`` (or ``axes``) when given, else on a new
figure.

The window's timeline is recorded, not drawn by hand: :class:`TimelineRecorder` hooks a
real run (forward, backward, DDP gradient sync, unscale, check, clip, step, clear) and
keeps its events in order; :func:`record_window` records one ``train_window`` call;
:func:`timeline_boxes` lays the events out and :func:`plot_window_timeline` draws them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from accumlab.memory_records import WindowRecord


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


# ----------------------------------------------------------------------------- the window's timeline

#: What :class:`TimelineRecorder` records, in the order a correct window makes them (the
#: microbatch side, then the boundary): ``"skip"`` is a ``scaler.step`` that made no
#: ``optimizer.step()`` call.
EVENT_KINDS = (
    "forward",
    "backward",
    "sync",
    "unscale",
    "check",
    "clip",
    "step",
    "skip",
    "update scale",
    "clear",
)
_COLORS = {
    "forward": "#9ecae1",
    "backward": "#3182bd",
    "sync": "#e6550d",
    "unscale": "#fdae6b",
    "check": "#a1d99b",
    "clip": "#74c476",
    "step": "#31a354",
    "skip": "#de2d26",
    "update scale": "#bcbddc",
    "clear": "#d9d9d9",
}
_DARK = {_COLORS[k] for k in ("backward", "sync", "step", "skip")}


@dataclass(frozen=True)
class WindowEvent:
    """One thing that happened on one rank during a recorded window.

    ``kind`` is one of :data:`EVENT_KINDS`; ``microbatch`` is the index of the microbatch a
    forward, backward or sync belongs to (None at the boundary); ``start`` and ``end`` are
    ``time.perf_counter()`` seconds (an instant event has ``end == start``); ``detail`` is
    ``"non-finite"`` for a check that found an inf or nan, else empty.
    """

    rank: int
    kind: str
    start: float
    end: float
    microbatch: int | None = None
    detail: str = ""

    @property
    def label(self) -> str:
        """The short text drawn in its box: ``F2``/``B2`` for microbatch 2, else the kind."""
        if self.kind in ("forward", "backward"):
            return f"{self.kind[0].upper()}{self.microbatch}"
        if self.kind == "check":
            return "check\ninf!" if self.detail == "non-finite" else "check"
        return {"skip": "step\nskipped", "update scale": "update\nscale"}.get(self.kind, self.kind)


class _HookState:
    """The DDP communication hook's state: which recorder listens (None: nobody)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.recorder: TimelineRecorder | None = None


def _recording_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them at run time and rejects string annotations.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if state.recorder is not None:
        state.recorder._bucket(bucket.is_last())
    return allreduce_hook(state.group, bucket)


class TimelineRecorder:
    """Record when each step of a window runs, in order and timed, on this rank: the
    time-line :func:`plot_window_timeline` draws. A context manager.

    Inside ``with TimelineRecorder(model, optimizer, scaler) as rec:`` every forward pass
    (module forward pre/post hooks), backward pass (from the first to the last parameter
    gradient: ``torch.autograd.graph.register_multi_grad_hook``), DDP gradient
    synchronization (a DDP communication hook that all-reduces exactly like DDP's default),
    ``scaler.unscale_``/``step``/``update``, gradient-norm check (``accumlab.loop``'s
    ``total_grad_norm``), clip (``torch.nn.utils.clip_grad_norm_`` or
    ``clip_grads_with_norm_``), ``optimizer.step()`` (step pre/post hooks) and
    ``optimizer.zero_grad()`` is appended to ``rec.events`` as a :class:`WindowEvent` with
    ``time.perf_counter()`` times. Everything is removed on exit, except the DDP hook (DDP
    cannot remove one; it stays a plain all-reduce that records nothing). A DDP model takes
    one communication hook, so do not also attach a ``SyncCounter``: count the ``"sync"``
    events instead. One recorder at a time (it patches two module functions).

    It records when, not what: the loop audit's ``UpdateTrace``
    (:mod:`accumlab.loop_audit.trace`) records which examples and weights reached each
    update, patches no module function, and runs no clock.
    """

    _active = False

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        scaler: Any = None,
        *,
        rank: int | None = None,
    ) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
            )
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.events: list[WindowEvent] = []
        self._undo: list[Any] = []
        self._forwards = 0
        self._open: dict[str, float] = {}
        self._stepped = False

    # -- recording
    def _add(
        self, kind: str, start: float, microbatch: int | None = None, detail: str = ""
    ) -> None:
        import time

        self.events.append(
            WindowEvent(self.rank, kind, start, time.perf_counter(), microbatch, detail)
        )

    def _microbatch(self) -> int:
        return max(self._forwards - 1, 0)

    def _bucket(self, last: bool) -> None:
        import time

        self._open.setdefault("sync", time.perf_counter())
        if last:
            self._add("sync", self._open.pop("sync"), self._microbatch())

    def _wrap(self, owner: Any, name: str, kind: str, *, instance: bool) -> None:
        """Replace ``owner.name`` by a version that records ``kind`` around the call."""
        import time

        original = getattr(owner, name)
        recorder = self

        def recorded(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            if kind == "skip":  # scaler.step: a "step" event appears only if the optimizer steps
                recorder._stepped = False
                out = original(*args, **kwargs)
                if not recorder._stepped:
                    recorder._add("skip", start)
                return out
            out = original(*args, **kwargs)
            detail = ""
            if kind == "check" and not math.isfinite(out[1]):
                detail = "non-finite"
            recorder._add(kind, start, detail=detail)
            return out

        had = instance and name in vars(owner)
        setattr(owner, name, recorded)

        def undo() -> None:
            if instance and not had:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

        self._undo.append(undo)

    def __enter__(self) -> TimelineRecorder:
        if TimelineRecorder._active:
            raise RuntimeError("a TimelineRecorder is already recording; nest none")
        TimelineRecorder._active = True
        try:
            self._install()
        except BaseException:
            self.__exit__()  # undo what was installed before the failure
            raise
        return self

    def _install(self) -> None:
        """Register the hooks and wrappers (``__enter__``), each with its undo step."""
        import time

        import torch
        from torch.nn.parallel import DistributedDataParallel

        from accumlab import loop
        from accumlab.parallel import unwrap

        model = self.model

        def pre(module: Any, args: Any) -> None:
            self._forwards += 1
            self._open["forward"] = time.perf_counter()

        def post(module: Any, args: Any, output: Any) -> None:
            self._add("forward", self._open.pop("forward"), self._microbatch())

        hook = self._undo.append  # each registration's remove, at once
        hook(model.register_forward_pre_hook(pre).remove)
        hook(model.register_forward_hook(post).remove)
        params = [p for p in model.parameters() if p.requires_grad]
        if params:

            def first(grads: Any) -> None:
                self._open["backward"] = time.perf_counter()

            def last(grads: Any) -> None:
                self._add("backward", self._open.pop("backward"), self._microbatch())

            graph = torch.autograd.graph
            hook(graph.register_multi_grad_hook(params, first, mode="any").remove)
            hook(graph.register_multi_grad_hook(params, last, mode="all").remove)

        def step_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._open["step"] = time.perf_counter()

        def step_post(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._stepped = True
            self._add("step", self._open.pop("step"))

        hook(self.optimizer.register_step_pre_hook(step_pre).remove)
        hook(self.optimizer.register_step_post_hook(step_post).remove)
        self._wrap(self.optimizer, "zero_grad", "clear", instance=True)
        if self.scaler is not None:
            self._wrap(self.scaler, "unscale_", "unscale", instance=True)
            self._wrap(self.scaler, "step", "skip", instance=True)
            self._wrap(self.scaler, "update", "update scale", instance=True)
        self._wrap(loop, "total_grad_norm", "check", instance=False)
        self._wrap(torch.nn.utils, "clip_grad_norm_", "clip", instance=False)
        self._wrap(torch.nn.utils, "clip_grads_with_norm_", "clip", instance=False)
        inner = unwrap(model)
        if isinstance(inner, DistributedDataParallel):
            state = getattr(inner, "_accumlab_recorder_state", None)
            if state is None:
                state = _HookState(inner.process_group)
                inner.register_comm_hook(state, _recording_comm_hook)
                inner._accumlab_recorder_state = state
            state.recorder = self
            self._undo.append(lambda: setattr(state, "recorder", None))

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()
        TimelineRecorder._active = False

    def count(self, kind: str) -> int:
        """How many ``kind`` events were recorded (e.g. ``"sync"``)."""
        return sum(e.kind == kind for e in self.events)


def record_window(
    model: Any,
    window: Sequence[Mapping[str, Any]],
    optimizer: Any,
    objective: Any,
    **train_window_kwargs: Any,
) -> list[WindowEvent]:
    """Run ``accumlab.train_window(model, window, optimizer, objective, **kwargs)`` once
    inside a :class:`TimelineRecorder` and return its events in the order they happened.

    Single device, e.g. in notebook 01::

        events = record_window(model, window, optimizer, objective,
                               forward=lambda m, mb: m(mb["x"]), clip_grad_norm=1.0)
        plot_window_timeline({"one device": events})

    ``scaler=`` is passed on to ``train_window`` and recorded too. Under DDP, call it on
    every rank (it is a window like any other); the events carry the rank.
    """
    from accumlab.loop import train_window

    scaler = train_window_kwargs.get("scaler")
    with TimelineRecorder(model, optimizer, scaler) as recorder:
        train_window(model, window, optimizer, objective, **train_window_kwargs)
    return recorder.events


@dataclass(frozen=True)
class TimelineBox:
    """One drawn event: its lane (row, from the top), left edge ``x``, ``width``, text and
    kind (which sets the colour)."""

    lane: int
    x: float
    width: float
    label: str
    kind: str

    @property
    def color(self) -> str:
        """The fill colour: the kind's, red for a check that found an inf or nan."""
        return _COLORS["skip"] if self.label == "check\ninf!" else _COLORS[self.kind]

    @property
    def text_color(self) -> str:
        """Black on light fills, white on dark ones."""
        return "white" if self.color in _DARK else "black"


def timeline_boxes(
    runs: Mapping[str, Sequence[WindowEvent]], *, order: bool = True
) -> tuple[list[str], list[TimelineBox]]:
    """Lay out recorded windows: one lane per run and rank, in the order given.

    ``runs`` maps a run's label to its events (from one or several ranks). With
    ``order=True`` each lane's events sit at x = 0, 1, 2, ... in the order they started (width
    0.9: order, not duration, is what a window's correctness depends on); with ``order=False``
    at their real time in milliseconds since the run's first event. Returns the lane labels
    (``"label"``, or ``"label · rank r"`` when a run has several ranks) and the boxes.
    """
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(
            "runs must be a non-empty mapping from a label to a list of WindowEvent, e.g. "
            "{'one device': record_window(...)}"
        )
    lanes: list[str] = []
    boxes: list[TimelineBox] = []
    for label, events in runs.items():
        events = list(events)
        if not events:
            raise ValueError(f"runs[{label!r}] holds no events: was the window recorded?")
        for e in events:
            if not isinstance(e, WindowEvent):
                raise TypeError(
                    f"runs[{label!r}] must hold WindowEvent objects, got {type(e).__name__}"
                )
        t0 = min(e.start for e in events)
        ranks = sorted({e.rank for e in events})
        for rank in ranks:
            lane = len(lanes)
            lanes.append(str(label) if len(ranks) == 1 else f"{label} · rank {rank}")
            mine = sorted((e for e in events if e.rank == rank), key=lambda e: (e.start, e.end))
            for i, e in enumerate(mine):
                if order:
                    x, width = float(i), 0.9
                else:
                    x, width = (e.start - t0) * 1e3, max((e.end - e.start) * 1e3, 1e-3)
                boxes.append(TimelineBox(lane, x, width, e.label, e.kind))
    return lanes, boxes


def plot_window_timeline(
    runs: Mapping[str, Sequence[WindowEvent]],
    *,
    order: bool = True,
    title: str | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Draw recorded windows (see :func:`timeline_boxes`): one lane per run and rank, one
    labelled box per event, coloured by kind, with a legend of the kinds that occur.

    ``runs`` maps a label to the events of :func:`record_window` (or a
    :class:`TimelineRecorder`), e.g. ``{"one device": events}``; DDP ranks' events of one run
    go under one label and get a lane each. ``order=False`` draws real time (ms) instead
    of the order axis; labels are then left out (the boxes are too narrow to read).
    """
    from matplotlib.patches import Patch

    lanes, boxes = timeline_boxes(runs, order=order)
    if ax is None:
        import matplotlib.pyplot as plt

        longest = max(sum(b.lane == i for b in boxes) for i in range(len(lanes)))
        _, ax = plt.subplots(figsize=(max(6.4, 0.55 * longest + 2.5), 0.75 * len(lanes) + 1.3))
    for b in boxes:
        y = len(lanes) - 1 - b.lane
        ax.barh(y, b.width, left=b.x, height=0.7, color=b.color, edgecolor="black", lw=0.5)
        if order:
            ax.text(
                b.x + b.width / 2,
                y,
                b.label,
                ha="center",
                va="center",
                fontsize=7,
                color=b.text_color,
            )
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel("order of events" if order else "time since the window began (ms)")
    if order:
        ax.set_xticks([])
    kinds = [k for k in EVENT_KINDS if any(b.kind == k for b in boxes)]
    ax.legend(
        handles=[Patch(facecolor=_COLORS[k], edgecolor="black", label=k) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08 if order else -0.25),
        ncol=len(kinds),
        fontsize=7,
        frameon=False,
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title)
    return ax


# --------------------------------------------------------------------------- memory


def plot_memory_window(window: WindowRecord, ax: Axes | None = None) -> Axes:
    """Bars of live bytes at each phase's entry and its peak, baseline first (MiB), for one
    window a :class:`~accumlab.memory.MemoryMeter` recorded (``meter.windows[i]``)."""
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(8, 3))
    labels = ["baseline"] + [
        p.name if p.microbatch is None else f"{p.name[0]}{p.microbatch}" for p in window.phases
    ]
    start = [window.baseline_bytes] + [p.start_bytes for p in window.phases]
    peak = [window.baseline_bytes] + [p.peak_bytes for p in window.phases]
    mib = 2**20
    xs = range(len(labels))
    ax.bar(xs, [b / mib for b in peak], color="tab:orange", label="peak in phase")
    ax.bar(xs, [b / mib for b in start], color="tab:blue", label="live at entry")
    ax.set_xticks(list(xs), labels, rotation=0, fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title(f"window {window.index}: f = forward, b = backward (microbatch index)")
    ax.legend(loc="upper left", fontsize=8)
    return ax


def plot_memory_breakdown(rows: Sequence[Mapping[str, Any]], ax: Axes | None = None) -> Axes:
    """Stacked bars, one per row: ``weights``, ``gradients``, ``optimizer_state`` and
    ``activations`` (activations and temporaries) bytes under the row's ``label`` (e.g.
    ``"m=4 × A=2"``), drawn in MiB; returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    parts = [
        ("weights", "tab:gray", "weights"),
        ("gradients", "tab:green", "gradients"),
        ("optimizer_state", "tab:purple", "optimizer state"),
        ("activations", "tab:orange", "activations and temporaries"),
    ]
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, color, label in parts:
        heights = [r[key] / 2**20 for r in rows]
        ax.bar(xs, heights, bottom=bottom, color=color, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(xs, [r["label"] for r in rows])
    ax.set_ylabel("peak MiB")
    ax.legend(fontsize=8)
    return ax
