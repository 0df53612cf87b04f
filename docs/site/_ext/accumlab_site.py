"""Sphinx extension of the course site: what makes the notebooks read well as pages, offline.

- ipywidgets drawn from their saved state (below);
- names of the package in the lessons' code spans (```al.train_window```,
  ```accumlab.MemoryMeter```, ```ex01.adamw_ratio.check```) link to the API reference;
- a saved figure opens full size when tapped (a link to the image itself);
- MathJax 2 from the ``jupyter-server-mathjax`` package is copied into the site.

The widgets:

myst-nb writes a widget output as ``<script type="application/vnd.jupyter.widget-view+json">``
and expects ipywidgets' JavaScript (from a CDN) to draw it from the notebook's saved widget
state. The site is read offline and must not depend on a CDN, so this extension replaces
each such script with static HTML built from the saved state: boxes as rows and columns,
sliders as disabled range inputs with their saved value, labels and HTML as they are, an
Output widget's saved outputs as text or images. A reader sees the widget as it was saved,
with a note that it moves when the notebook runs. (The course's own explorers are saved as
their drawing already, ``text/html`` that the page shows as it is: ``tools/run_notebooks.py``
keeps no live view or state of them. This transform draws any other saved widget.)
"""

from __future__ import annotations

import html
import importlib
import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform
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


def widget_settings(state: dict[str, Any]) -> list[str]:
    """"description value" of every slider and choice in a saved widget state (the alt text
    of the figure the widget drew names them)."""
    found = []
    for model in state.values():
        s = model.get("state", {})
        name = model.get("model_name", "")
        description = str(s.get("description", "") or "").strip().rstrip(":")
        if name.endswith("SliderModel") and description:
            found.append(f"{description} {_format(s.get('value'), s.get('readout_format'))}")
        elif name in ("DropdownModel", "RadioButtonsModel", "ToggleButtonsModel") and description:
            options, index = s.get("_options_labels", []), s.get("index")
            if isinstance(index, int) and 0 <= index < len(options):
                found.append(f"{description} {options[index]}")
    return found


def render_model(model_id: str, state: dict[str, Any], settings: list[str] | None = None) -> str:
    """Static HTML for the widget ``model_id`` and its children, from ``state`` (the
    ``state`` mapping of a notebook's widget-state metadata)."""
    if settings is None:
        settings = widget_settings(state)
    if model_id not in state:
        raise WidgetStateError(f"widget model {model_id} is not in the notebook's saved state")
    model = state[model_id]
    name = model.get("model_name", "")
    s = model.get("state", {})
    description = html.escape(str(s.get("description", "") or ""))
    label = f'<span class="sw-description">{description}</span>' if description else ""

    def children() -> str:
        refs = [c for c in s.get("children", []) if isinstance(c, str) and c.startswith(_REF)]
        return "".join(render_model(ref[len(_REF) :], state, settings) for ref in refs)

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
        alt = "figure drawn by the widget at its saved settings"
        if settings:
            alt += ": " + ", ".join(settings)
        return f'<div class="sw-output">{_outputs_html(s.get("outputs", []), alt)}</div>'
    return f'<div class="sw-label">[{html.escape(name or "widget")}]</div>'


def _outputs_html(outputs: list[dict[str, Any]], alt: str = "figure drawn by the widget") -> str:
    parts = []
    for out in outputs:
        if out.get("output_type") == "stream":
            parts.append(f"<pre>{html.escape(''.join(out.get('text', '')))}</pre>")
            continue
        data = out.get("data", {})
        if "image/png" in data:
            png = "".join(data["image/png"]).replace("\n", "")
            parts.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{png}">')
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


# --- names in the lessons link to the API reference ----------------------------------------

_NAME = re.compile(r"^(?P<path>[A-Za-z_][\w.]*?)(?:\(.*\))?$", re.DOTALL)
_EXERCISE_CALL = re.compile(r"^(ex\d\d)\.(\w+)(?:\.(?:check|hint|solution))?$")


def public_targets() -> dict[str, str]:
    """{how a lesson may write a name: its reference target}: ``al.X``, ``accumlab.X`` and
    the bare ``X`` (for names with an underscore or a capital) of ``accumlab.__all__``,
    ``accumlab.distributed.X`` of its ``__all__``, and ``exNN.name`` of every checker."""
    import accumlab

    targets: dict[str, str] = {}
    for name in accumlab.__all__:
        full = f"accumlab.{name}"
        targets[full] = targets[f"al.{name}"] = full
        if "_" in name or name[:1].isupper():
            targets[name] = full
    for sub in ("distributed",):
        module = importlib.import_module(f"accumlab.{sub}")
        for name in getattr(module, "__all__", []):
            full = f"accumlab.{sub}.{name}"
            targets[full] = targets[f"al.{sub}.{name}"] = full
    exercises = importlib.import_module("accumlab_course.exercises")
    for path in sorted(Path(exercises.__file__).parent.glob("ex[0-9][0-9].py")):
        module = importlib.import_module(f"accumlab_course.exercises.{path.stem}")
        for name, value in vars(module).items():
            if isinstance(value, exercises.Exercise):
                targets[f"{path.stem}.{name}"] = f"accumlab_course.exercises.{path.stem}.{name}"
    return targets


def target_of(text: str, targets: dict[str, str]) -> str | None:
    """The reference target a code span names (``al.train_window(...)``,
    ``ex01.adamw_ratio.check``, ``MemoryMeter.plot``), or None."""
    match = _NAME.match(text.strip())
    if not match:
        return None
    path = match.group("path")
    exercise = _EXERCISE_CALL.match(path)
    if exercise:
        path = f"{exercise.group(1)}.{exercise.group(2)}"
    if path in targets:
        return targets[path]
    head, _, attribute = path.rpartition(".")  # a method or field: its class's entry
    if head in targets and attribute.isidentifier():
        return targets[head]
    return None


class LinkPublicNames(SphinxTransform):
    """A code span in a lesson or a doc page that names a public name links to its entry."""

    default_priority = 500

    def apply(self, **kwargs: Any) -> None:
        if not self.env.docname.startswith(("lessons/", "docs/", "exercises", "index")):
            return
        targets = self.env.app.accumlab_targets  # type: ignore[attr-defined]
        for node in list(self.document.findall(nodes.literal)):
            if isinstance(node.parent, (nodes.reference, nodes.title, addnodes.pending_xref)):
                continue
            target = target_of(node.astext(), targets)
            if target is None:
                continue
            ref = addnodes.pending_xref(
                "", refdomain="py", reftype="obj", reftarget=target, refexplicit=True,
                refwarn=False, refdoc=self.env.docname,
            )  # fmt: skip
            node.replace_self(ref)
            ref += node


# --- figures full size -------------------------------------------------------------------

_OUTPUT_IMG = re.compile(r'(<img\b[^>]*\bsrc="(?P<src>[^"]*_images/[^"]+)"[^>]*>)')


def link_figures(body: str) -> str:
    """Every saved figure (an image in ``_images/``, where myst-nb puts the outputs') opens
    full size when tapped: wrapped in a link to the image file."""
    return _OUTPUT_IMG.sub(
        lambda m: f'<a class="al-figure" href="{m.group("src")}" title="open the figure full size">{m.group(1)}</a>',
        body,
    )


def _page_context(app: Sphinx, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    if "body" in context:
        context["body"] = link_figures(context["body"])


# --- MathJax from the jupyter-server-mathjax package ----------------------------------------

# What the site needs of MathJax 2: the loader, the combined TeX-to-HTML-CSS configuration,
# its extensions (without the 4 MB accessibility maps) and the STIX web fonts.
_MATHJAX_PARTS = ("MathJax.js", "LICENSE", "config", "extensions", "jax/input", "jax/element",
                  "jax/output/HTML-CSS", "fonts/HTML-CSS/STIX-Web/woff", "localization/en")


def mathjax_static(build: Path) -> Path:
    """A folder holding ``mathjax/`` (for ``html_static_path``), copied from the
    ``jupyter-server-mathjax`` package once; raises a clear error when it is missing."""
    spec = importlib.util.find_spec("jupyter_server_mathjax")  # its files only: no import
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the site needs MathJax from the jupyter-server-mathjax package: "
            "pip install -e '.[site]' (make site installs it)"
        )
    source = Path(next(iter(spec.submodule_search_locations))) / "static"
    folder = build / "site-mathjax"
    dest = folder / "mathjax"
    stamp = dest / ".copied-from"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == str(source):
        return folder
    if dest.exists():
        shutil.rmtree(dest)
    for part in _MATHJAX_PARTS:
        src = source / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("a11y"))
        elif src.is_file():
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)
        else:
            raise RuntimeError(f"{source}: MathJax's {part} is missing (jupyter-server-mathjax changed?)")
    stamp.write_text(str(source), encoding="utf-8")
    return folder


def _builder_inited(app: Sphinx) -> None:
    app.accumlab_targets = public_targets()  # type: ignore[attr-defined]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_post_transform(StaticWidgets)
    app.add_transform(LinkPublicNames)
    app.connect("builder-inited", _builder_inited)
    app.connect("html-page-context", _page_context)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
