"""Sphinx extension of the course site: ipywidgets drawn from their saved state, offline.

myst-nb writes a widget output as ``<script type="application/vnd.jupyter.widget-view+json">``
and expects ipywidgets' JavaScript (from a CDN) to draw it from the notebook's saved widget
state. The site is read offline and must not depend on a CDN, so this extension replaces
each such script with static HTML built from the saved state: boxes as rows and columns,
sliders as disabled range inputs with their saved value, labels and HTML as they are, an
Output widget's saved outputs as text or images. A reader sees the widget as it was saved,
with a note that it moves when the notebook runs.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform

VIEW_MIME = "application/vnd.jupyter.widget-view+json"
STATE_MIME = "application/vnd.jupyter.widget-state+json"
_VIEW_SCRIPT = re.compile(
    r'^<script type="' + re.escape(VIEW_MIME) + r'">(?P<body>.*)</script>$', re.DOTALL
)
_REF = "IPY_MODEL_"
NOTE = (
    "Interactive widget, shown as saved. Run the notebook to move the sliders "
    "(see “Run this notebook” at the top of the page)."
)


class WidgetStateError(ValueError):
    """A widget view refers to a model the notebook's saved state does not hold."""


def _format(value: Any, fmt: str | None) -> str:
    try:
        return format(value, fmt or "")
    except (TypeError, ValueError):
        return str(value)


def render_model(model_id: str, state: dict[str, Any]) -> str:
    """Static HTML for the widget ``model_id`` and its children, from ``state`` (the
    ``state`` mapping of a notebook's widget-state metadata)."""
    if model_id not in state:
        raise WidgetStateError(f"widget model {model_id} is not in the notebook's saved state")
    model = state[model_id]
    name = model.get("model_name", "")
    s = model.get("state", {})
    description = html.escape(str(s.get("description", "") or ""))
    label = f'<span class="sw-description">{description}</span>' if description else ""

    def children() -> str:
        refs = [c for c in s.get("children", []) if isinstance(c, str) and c.startswith(_REF)]
        return "".join(render_model(ref[len(_REF) :], state) for ref in refs)

    if name in ("VBoxModel", "BoxModel", "GridBoxModel", "AccordionModel", "TabModel"):
        return f'<div class="sw-vbox">{children()}</div>'
    if name == "HBoxModel":
        return f'<div class="sw-hbox">{children()}</div>'
    if name in ("IntSliderModel", "FloatSliderModel", "FloatLogSliderModel"):
        value, low, high = s.get("value", 0), s.get("min", 0), s.get("max", 100)
        step = s.get("step", 1)
        readout = html.escape(_format(value, s.get("readout_format")))
        aria = description or "slider"
        return (
            f'<div class="sw-slider">{label}<input type="range" min="{low}" max="{high}" '
            f'step="{step}" value="{value}" disabled aria-label="{aria}">'
            f'<output class="sw-readout">{readout}</output></div>'
        )
    if name in ("LabelModel", "TextModel", "IntTextModel", "FloatTextModel"):
        return f'<div class="sw-label">{label}<span>{html.escape(str(s.get("value", "")))}</span></div>'
    if name == "HTMLModel":
        return f'<div class="sw-html">{label}{s.get("value", "")}</div>'
    if name in ("CheckboxModel", "ToggleButtonModel"):
        checked = " checked" if s.get("value") else ""
        return f'<div class="sw-label"><input type="checkbox" disabled{checked}> {description}</div>'
    if name in ("DropdownModel", "RadioButtonsModel", "SelectModel", "ToggleButtonsModel"):
        options = s.get("_options_labels", [])
        index = s.get("index")
        chosen = options[index] if isinstance(index, int) and 0 <= index < len(options) else ""
        return f'<div class="sw-label">{label}<span>{html.escape(str(chosen))}</span></div>'
    if name == "OutputModel":
        return f'<div class="sw-output">{_outputs_html(s.get("outputs", []))}</div>'
    return f'<div class="sw-label">[{html.escape(name or "widget")}]</div>'


def _outputs_html(outputs: list[dict[str, Any]]) -> str:
    parts = []
    for out in outputs:
        if out.get("output_type") == "stream":
            parts.append(f"<pre>{html.escape(''.join(out.get('text', '')))}</pre>")
            continue
        data = out.get("data", {})
        if "image/png" in data:
            png = "".join(data["image/png"]).replace("\n", "")
            parts.append(f'<img alt="widget output" src="data:image/png;base64,{png}">')
        elif "text/html" in data:
            parts.append("".join(data["text/html"]))
        elif "text/plain" in data:
            parts.append(f"<pre>{html.escape(''.join(data['text/plain']))}</pre>")
    return "".join(parts)


def widget_html(view: dict[str, Any], state: dict[str, Any]) -> str:
    """The static figure for one widget view (``{"model_id": ...}``)."""
    body = render_model(view["model_id"], state)
    return (
        '<div class="static-widget" role="group" aria-label="interactive widget, as saved">'
        f'<p class="sw-note">{html.escape(NOTE)}</p>{body}</div>'
    )


def notebook_widget_state(path: Path) -> dict[str, Any]:
    """The ``state`` mapping of a notebook's saved widget state ({} when it has none)."""
    if path.suffix != ".ipynb":
        return {}
    metadata = json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
    return metadata.get("widgets", {}).get(STATE_MIME, {}).get("state", {})


class StaticWidgets(SphinxPostTransform):
    """Replace every widget-view script of a page with its static drawing."""

    default_priority = 900
    formats = ("html",)

    def run(self, **kwargs: Any) -> None:
        state: dict[str, Any] | None = None
        for node in list(self.document.findall(nodes.raw)):
            match = _VIEW_SCRIPT.match(node.astext().strip())
            if not match:
                continue
            if state is None:
                state = notebook_widget_state(Path(self.env.doc2path(self.env.docname)))
            # myst-nb escapes '</' inside scripts as '<\/'; json reads that back as '/'.
            view = json.loads(match.group("body"))
            try:
                drawn = widget_html(view, state)
            except WidgetStateError as err:
                raise WidgetStateError(f"{self.env.docname}: {err}") from None
            node.replace_self(nodes.raw("", drawn, format="html"))


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_post_transform(StaticWidgets)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
