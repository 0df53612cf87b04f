"""A saved notebook shows its widgets as drawings, not as state restored without a kernel.

JupyterLab draws a widget from the notebook's saved widget state with no kernel behind it
and marks each of its parts with a red "disconnected" icon until the cell runs again (7 in
notebook 00, 23 in 02). The course's explorers display a ``text/html`` drawing beside the
live view, and ``tools/run_notebooks.py`` saves the drawing alone.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def runner():
    return importlib.import_module("run_notebooks")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_widget_is_saved_as_state_without_a_kernel(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    views = [i for i, cell in enumerate(nb["cells"]) for out in cell.get("outputs", [])
             if VIEW in out.get("data", {})]
    assert views == [], (f"{path.name}: cells {views} save a live widget view (JupyterLab marks it "
                         "disconnected); re-execute with tools/run_notebooks.py")
    assert "widgets" not in nb["metadata"], f"{path.name} saves widget state; re-execute it"


def _output(data: dict) -> dict:
    return {"output_type": "execute_result", "execution_count": 1, "metadata": {}, "data": data}


def test_the_runner_saves_the_drawing_and_drops_the_state(runner):
    drawn = _output({"text/plain": "calculator", "text/html": "<div>drawing</div>",
                     VIEW: {"model_id": "a"}})
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("w", outputs=[drawn])]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {"a": {}}}}
    assert runner.save_widgets_drawn(nb) == 1
    assert nb.cells[0].outputs[0]["data"] == {"text/plain": "calculator", "text/html": "<div>drawing</div>"}
    assert "widgets" not in nb.metadata


def test_a_widget_without_a_drawing_keeps_its_state(runner):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("w", outputs=[_output({"text/plain": "w", VIEW: {"model_id": "b"}})])]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {"b": {}}}}
    assert runner.save_widgets_drawn(nb) == 0
    assert VIEW in nb.cells[0].outputs[0]["data"] and "widgets" in nb.metadata
