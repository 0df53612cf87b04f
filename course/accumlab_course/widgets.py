"""Notebook widgets, each built on a pure function that a test and the next cell also call.

Every widget here is a thin layer of sliders over a pure function that does the
arithmetic: the pure function is the part to trust and to test; the widget only calls it
and shows the result. The functions are independent of one another, so a new explorer
is one more pure function plus one more ``*_widget()`` builder.

``ipywidgets`` is imported inside the builders, so importing this module never needs a
notebook front end.

A widget is saved in a notebook as a picture, not as live state. Each builder returns an
explorer that displays itself both ways: the live widget (for a running kernel) and
:func:`static_html`, the same controls and table drawn once, at their settings, with a
line saying that running the cell brings the sliders to life. ``tools/run_notebooks.py``
saves the drawing and drops the live part and its state: a widget restored from saved
state has no kernel behind it, so JupyterLab marks every one of its parts with a red
"disconnected" icon until the cell runs again (7 in notebook 00 and 23 in 02 when the
state was saved). A wide table scrolls sideways inside its own box, with a line under it
that says so (:func:`scrolling`).
"""

from __future__ import annotations

import functools
import html
import math
from collections.abc import Sequence
from typing import Any

from accumlab.validate import check_positive_int

# --- layout shared by the widgets ------------------------------------------------------

#: Inline style of every table cell: a gap between columns, so headers never run together.
CELL_STYLE = "padding:2px 12px"

#: Extra inline style of a header cell: lines break only where the header says so.
HEADER_STYLE = "white-space:nowrap;vertical-align:bottom"

#: Room a slider's value readout and margins take in JupyterLab (ipywidgets 8), in px,
#: as measured by tools/check_widgets.py: the track is the width less label and this.
READOUT_PX = 96


def slider_layout(label_px: int, track_px: int) -> dict[str, Any]:
    """Keyword arguments giving an ipywidgets slider a ``label_px`` wide label column and
    a track about ``track_px`` wide (both in CSS pixels), whatever its label's length.

    A slider left at ipywidgets' default width (300 px in JupyterLab) gives its label what
    it needs and the track the rest, which for a long label is a few dozen pixels: a drag
    then jumps across most of the range. Fixed columns keep the track usable with a mouse.
    """
    import ipywidgets as widgets

    return {
        "layout": widgets.Layout(width=f"{label_px + track_px + READOUT_PX}px"),
        "style": {"description_width": f"{label_px}px"},
    }


#: What a table's box says under a table that may be wider than a phone's screen.
SCROLL_HINT = "A wide table: on a narrow screen, swipe or scroll it sideways."

#: The line on a saved explorer's drawing (in the notebook before a run, and on the site).
SAVED_NOTE = "Interactive widget, shown as saved: run this cell to move its sliders."


def scrolling(table_html: str) -> str:
    """``table_html`` in a box that scrolls sideways when the table is wider than the page
    (a phone), never widening the page, with :data:`SCROLL_HINT` under it, so a reader
    knows that columns hidden at the right are there."""
    return (
        '<div class="al-scroll" style="overflow-x:auto;max-width:100%">'
        f"{table_html}</div>"
        f'<div class="al-scroll-hint" style="font-size:0.8em;opacity:0.7">{html.escape(SCROLL_HINT)}</div>'
    )


def _readout(slider: Any) -> str:
    fmt = getattr(slider, "readout_format", "") or ""
    try:
        return format(slider.value, fmt)
    except (TypeError, ValueError):
        return str(slider.value)


def static_html(widget: Any, named: str = "") -> str:
    """HTML drawing of ``widget`` and its children at their current values: boxes as rows
    and columns, a slider as its description, a disabled range input and its readout, a
    label as its text, an ``HTML`` widget as its value. What a notebook shows before its
    cell runs again, and the site shows, in place of the live widget. A slider without a
    description is named (for a screen reader) by ``named``, the label just above it.
    Raises ``TypeError`` for a widget it cannot draw, naming it."""
    import ipywidgets as widgets

    def inner(box: Any) -> str:
        parts, above = [], ""
        for child in box.children:
            parts.append(static_html(child, above))
            above = child.value if isinstance(child, widgets.Label) else ""
        return "".join(parts)

    if isinstance(widget, widgets.HBox):
        return (f'<div class="sw-hbox" style="display:flex;flex-wrap:wrap;gap:0.75rem;'
                f'align-items:center">{inner(widget)}</div>')
    if isinstance(widget, widgets.Box):  # VBox and the plain Box: a column
        return (f'<div class="sw-vbox" style="display:flex;flex-direction:column;'
                f'gap:0.25rem">{inner(widget)}</div>')
    if isinstance(widget, (widgets.IntSlider, widgets.FloatSlider)):
        description = html.escape(widget.description)
        label = (f'<span class="sw-description" style="display:inline-block;'
                 f'min-width:{widget.style.description_width or "0px"}">{description}</span>'
                 if description else "")
        return (
            f'<div class="sw-slider" style="display:flex;flex-wrap:wrap;align-items:center;'
            f'gap:0.5rem">{label}<input type="range" min="{widget.min}" max="{widget.max}" '
            f'step="{widget.step}" value="{widget.value}" disabled '
            f'aria-label="{description or html.escape(named) or "slider"}">'
            f'<output class="sw-readout">{html.escape(_readout(widget))}</output></div>'
        )
    if isinstance(widget, widgets.Label):
        return f'<div class="sw-label">{html.escape(widget.value)}</div>'
    if isinstance(widget, widgets.HTML):
        return f'<div class="sw-html">{widget.value}</div>'
    raise TypeError(f"static_html cannot draw a {type(widget).__name__}; add it here")


@functools.cache
def _explorer_class() -> type:
    """:class:`Explorer`, built on first use (ipywidgets is imported only then)."""
    import ipywidgets as widgets

    class Explorer(widgets.VBox):
        """A column of controls over a pure function that displays itself twice: the live
        widget, and the drawing a saved notebook keeps (``text/html``, by
        :func:`static_html`, under :data:`SAVED_NOTE`), with ``title`` as its plain text.
        A front end with a kernel shows the live widget; the saved file keeps the
        drawing (``tools/run_notebooks.py``)."""

        def __init__(self, children: Sequence[Any], title: str) -> None:
            super().__init__(list(children))
            self.title = title

        def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
            bundle = super()._repr_mimebundle_(**kwargs) or {}
            bundle["text/plain"] = f"{self.title}: {SAVED_NOTE}"
            bundle["text/html"] = (
                '<div class="static-widget" role="group" aria-label="interactive widget, '
                f'as saved"><p class="sw-note"><i>{html.escape(SAVED_NOTE)}</i></p>'
                f"{static_html(self)}</div>"
            )
            return bundle

    return Explorer


def explorer(children: Sequence[Any], title: str) -> Any:
    """An explorer (an ``ipywidgets.VBox`` of ``children``) named ``title`` that a saved
    notebook shows as a drawing (see :func:`static_html`)."""
    return _explorer_class()(children, title)


# --- effective batch (notebook 00) -----------------------------------------------------

#: Row labels of :func:`effective_batch_table`, in display order, with their units.
EFFECTIVE_BATCH_LABELS: dict[str, str] = {
    "gpus": "GPUs in the job (D × T × P)",
    "gpus_per_replica": "GPUs per replica (T × P, one model copy)",
    "replicas": "data-parallel replicas D",
    "micro_batch_size": "examples per microbatch m",
    "accumulation_steps": "microbatches per window A",
    "examples_per_replica_per_update": "examples per update on one replica (m × A)",
    "effective_batch_size": "effective batch: examples per update (m × A × D)",
    "forward_passes_per_update_per_replica": "forward/backward passes per update, per replica (A)",
    "forward_passes_per_update": "forward/backward passes per update, all replicas (A × D)",
}


def effective_batch_table(
    micro_batch_size: int,
    accumulation_steps: int,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> dict[str, int]:
    """What one update is made of, for ``m`` examples per microbatch, ``A`` microbatches
    per window, ``D`` data-parallel replicas, each replica split over ``T`` tensor-parallel
    × ``P`` pipeline-parallel GPUs.

    Only data-parallel replicas see different examples, so the effective batch is
    ``m × A × D`` examples per update whatever ``T`` and ``P`` are; the job uses
    ``D × T × P`` GPUs. All values are counts (ints); the keys are those of
    :data:`EFFECTIVE_BATCH_LABELS`. Raises ``TypeError``/``ValueError`` for a size that is
    not a positive int.
    """
    m = check_positive_int("micro_batch_size", micro_batch_size)
    a = check_positive_int("accumulation_steps", accumulation_steps)
    d = check_positive_int("data_parallel_size", data_parallel_size)
    t = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    p = check_positive_int("pipeline_parallel_size", pipeline_parallel_size)
    return {
        "gpus": d * t * p,
        "gpus_per_replica": t * p,
        "replicas": d,
        "micro_batch_size": m,
        "accumulation_steps": a,
        "examples_per_replica_per_update": m * a,
        "effective_batch_size": m * a * d,
        "forward_passes_per_update_per_replica": a,
        "forward_passes_per_update": a * d,
    }


def effective_batch_html(table: dict[str, int]) -> str:
    """Render a table from :func:`effective_batch_table` as an HTML table (labels with units),
    in a box that scrolls sideways on a narrow screen (:func:`scrolling`)."""
    missing = [key for key in EFFECTIVE_BATCH_LABELS if key not in table]
    if missing:
        raise ValueError(
            f"table is missing {missing}; build it with effective_batch_table(...)"
        )
    rows = "".join(
        f"<tr><td style='text-align:left;{CELL_STYLE}'>{html.escape(label)}</td>"
        f"<td style='text-align:right;{CELL_STYLE}'><b>{table[key]}</b></td></tr>"
        for key, label in EFFECTIVE_BATCH_LABELS.items()
    )
    return scrolling(f"<table>{rows}</table>")


def effective_batch_widget(
    micro_batch_size: int = 4,
    accumulation_steps: int = 8,
    data_parallel_size: int = 2,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> Any:
    """Sliders for m, A, D, T, P over :func:`effective_batch_table`; returns an
    :func:`explorer` (an ``ipywidgets.VBox``) whose last child is an ``HTML`` widget
    holding the table.

    Moving a slider recomputes the table with the pure function (no printing, so the
    widget behaves the same in JupyterLab, in VS Code and under nbval). The arguments are
    the sliders' starting values.
    """
    import ipywidgets as widgets

    start = effective_batch_table(
        micro_batch_size,
        accumulation_steps,
        data_parallel_size,
        tensor_parallel_size,
        pipeline_parallel_size,
    )
    columns = slider_layout(label_px=210, track_px=250)
    sliders = {
        "micro_batch_size": widgets.IntSlider(
            value=start["micro_batch_size"], min=1, max=max(64, micro_batch_size),
            description="m (examples / microbatch)", **columns,
        ),
        "accumulation_steps": widgets.IntSlider(
            value=start["accumulation_steps"], min=1, max=max(64, accumulation_steps),
            description="A (microbatches / window)", **columns,
        ),
        "data_parallel_size": widgets.IntSlider(
            value=start["replicas"], min=1, max=max(16, data_parallel_size),
            description="D (data-parallel replicas)", **columns,
        ),
        "tensor_parallel_size": widgets.IntSlider(
            value=tensor_parallel_size, min=1, max=max(8, tensor_parallel_size),
            description="T (tensor-parallel GPUs)", **columns,
        ),
        "pipeline_parallel_size": widgets.IntSlider(
            value=pipeline_parallel_size, min=1, max=max(8, pipeline_parallel_size),
            description="P (pipeline stages)", **columns,
        ),
    }
    output = widgets.HTML(value=effective_batch_html(start))

    def refresh(_change: object = None) -> None:
        table = effective_batch_table(**{name: s.value for name, s in sliders.items()})
        output.value = effective_batch_html(table)

    for slider in sliders.values():
        slider.observe(refresh, names="value")
    return explorer([*sliders.values(), output], "effective-batch calculator")


# --- token weighting (notebook 02) -----------------------------------------------------



def token_weighting(target_counts: Sequence[int], mean_losses: Sequence[float]) -> dict[str, Any]:
    """Two ways to turn the microbatches of one window into one loss, side by side.

    Microbatch ``i`` holds ``target_counts[i]`` supervised targets (after the shift,
    ignored labels excluded) whose mean loss is ``mean_losses[i]`` nats per target. With
    ``N`` the window's targets and ``A`` its microbatches, returns:

    - ``target_counts``, ``mean_losses``: the inputs, as a tuple of ints and of floats;
    - ``targets``: ``N = sum(target_counts)``;
    - ``token_mean``: ``sum(n_i * l_i) / N``, every target weighted ``1/N``: the
      full-batch loss, and what accumlab's loop backpropagates (nats per target);
    - ``average_of_averages``: ``sum(l_i) / A``, the mean of the per-microbatch means
      (a mean-reduced loss per microbatch divided by ``A``);
    - ``token_mean_weights``: ``n_i / N``, microbatch ``i``'s share of the window's loss
      under the token mean (the shares add up to 1);
    - ``average_of_averages_weights``: ``1 / A`` for every microbatch, whatever it holds;
    - ``target_weight_ratio``: ``N / (A * n_i)``, how many times as much one target of
      microbatch ``i`` counts under the average of averages as under the token mean
      (above 1 in microbatches smaller than average, below 1 in bigger ones).

    The two losses agree exactly when every microbatch holds the same number of targets
    (or every microbatch has the same mean loss). Raises ``ValueError``/``TypeError``
    when the sequences differ in length or are empty, a count is not a positive int, or
    a loss is not a finite number.
    """
    for name, values in (("target_counts", target_counts), ("mean_losses", mean_losses)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(
                f"{name} must be a sequence with one entry per microbatch, got "
                f"{type(values).__name__}"
            )
    if len(target_counts) != len(mean_losses) or not target_counts:
        raise ValueError(
            f"target_counts ({len(target_counts)} entries) and mean_losses "
            f"({len(mean_losses)} entries) need one entry per microbatch each, at least one"
        )
    counts = tuple(check_positive_int(f"target_counts[{i}]", n) for i, n in enumerate(target_counts))
    losses = []
    for i, loss in enumerate(mean_losses):
        if isinstance(loss, bool) or not isinstance(loss, (int, float)):
            raise TypeError(
                f"mean_losses[{i}] must be a number (nats per target), got "
                f"{type(loss).__name__} ({loss!r}); convert a tensor with float(t)"
            )
        if not math.isfinite(loss):
            raise ValueError(f"mean_losses[{i}] must be finite, got {loss!r}")
        losses.append(float(loss))
    total, a = sum(counts), len(counts)
    return {
        "target_counts": counts,
        "mean_losses": tuple(losses),
        "targets": total,
        "token_mean": math.fsum(n * loss for n, loss in zip(counts, losses, strict=True)) / total,
        "average_of_averages": math.fsum(losses) / a,
        "token_mean_weights": tuple(n / total for n in counts),
        "average_of_averages_weights": tuple(1 / a for _ in counts),
        "target_weight_ratio": tuple(total / (a * n) for n in counts),
    }


def _share_bar(share: float, colour: str) -> str:
    return (
        f"<div style='display:inline-block;width:{100 * share:.1f}px;height:0.8em;"
        f"background:{colour}'></div> {share:.3f}"
    )


def token_weighting_html(result: dict[str, Any]) -> str:
    """Render a result of :func:`token_weighting` as an HTML table: one row per
    microbatch (targets, mean loss, its share of the window under each scheme drawn as a
    bar 100 px per whole window, and the per-target weight ratio) in a box that scrolls
    sideways on a narrow screen (:func:`scrolling`), then both losses."""
    keys = ("target_counts", "mean_losses", "token_mean_weights",
            "average_of_averages_weights", "target_weight_ratio", "token_mean",
            "average_of_averages", "targets")
    missing = [key for key in keys if key not in result]
    if missing:
        raise ValueError(f"result is missing {missing}; build it with token_weighting(...)")
    # Headers break only at the chosen line ends (no-wrap otherwise): left to the browser,
    # "one target counts ×" wrapped in JupyterLab and left the "×" alone on a line.
    head = "".join(
        f"<th style='{CELL_STYLE};{HEADER_STYLE}'>"
        + "<br>".join(html.escape(line) for line in h.split("\n")) + "</th>"
        for h in ("microbatch", "targets", "mean loss\n(nats)", "share:\ntoken mean",
                  "share:\naverage of averages", "one target\ncounts ×")
    )
    rows = "".join(
        f"<tr><td style='{CELL_STYLE}'>{i}</td><td style='{CELL_STYLE}'>{n}</td>"
        f"<td style='{CELL_STYLE}'>{loss:.3f}</td>"
        f"<td style='text-align:left;{CELL_STYLE}'>{_share_bar(w_tok, '#4c72b0')}</td>"
        f"<td style='text-align:left;{CELL_STYLE}'>{_share_bar(w_avg, '#dd8452')}</td>"
        f"<td style='{CELL_STYLE}'>{ratio:.2f}</td></tr>"
        for i, (n, loss, w_tok, w_avg, ratio) in enumerate(
            zip(result["target_counts"], result["mean_losses"], result["token_mean_weights"],
                result["average_of_averages_weights"], result["target_weight_ratio"],
                strict=True)
        )
    )
    summary = (
        f"<p>window: {result['targets']} targets in {len(result['target_counts'])} "
        f"microbatches; token mean <b>{result['token_mean']:.4f}</b> nats, average of "
        f"averages <b>{result['average_of_averages']:.4f}</b> nats</p>"
    )
    return scrolling(f"<table><tr>{head}</tr>{rows}</table>") + summary


def token_weighting_widget(
    target_counts: Sequence[int] = (512, 1536, 64),
    mean_losses: Sequence[float] = (2.0, 4.0, 3.0),
) -> Any:
    """Sliders for each microbatch's target count and mean loss over
    :func:`token_weighting`; returns an :func:`explorer` (an ``ipywidgets.VBox``) with one row per microbatch
    and, last, an ``HTML`` widget holding :func:`token_weighting_html`. A row holds two
    ``VBox`` columns, each a ``Label`` above its slider: the target count, then the mean loss.

    The arguments set the number of microbatches and the sliders' starting values.
    Moving a slider recomputes the table with the pure function (no printing).
    """
    import ipywidgets as widgets

    start = token_weighting(target_counts, mean_losses)
    # Labels above the tracks: two sliders with their labels beside them do not fit a
    # notebook's width with a usable track each.
    track = slider_layout(label_px=0, track_px=240)
    counts = [
        widgets.IntSlider(value=n, min=1, max=max(4096, n), step=1, **track)
        for n in start["target_counts"]
    ]
    losses = [
        widgets.FloatSlider(value=loss, min=min(0.0, loss), max=max(8.0, loss), step=0.1,
                            **track)
        for loss in start["mean_losses"]
    ]
    output = widgets.HTML(value=token_weighting_html(start))

    def refresh(_change: object = None) -> None:
        result = token_weighting([s.value for s in counts], [s.value for s in losses])
        output.value = token_weighting_html(result)

    for slider in (*counts, *losses):
        slider.observe(refresh, names="value")
    rows = [
        widgets.HBox([
            widgets.VBox([widgets.Label(f"microbatch {i}: targets"), count]),
            widgets.VBox([widgets.Label(f"microbatch {i}: mean loss (nats)"), loss]),
        ])
        for i, (count, loss) in enumerate(zip(counts, losses, strict=True))
    ]
    return explorer([*rows, output], "token-weighting explorer")
