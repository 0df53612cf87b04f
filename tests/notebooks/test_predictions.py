"""Predict, then see: no prediction's answer is in view before the learner has written one.

A prediction is a cell calling ``exNN.<name>.check(...)`` where ``exNN.<name>.kind`` is
``"prediction"``; its ``answer`` is the value the revealing cell shows. In the saved
notebook:

- **above the question**: the answer appears in no markdown and no saved output. A number
  is looked for as written to 3-6 significant digits (``0.9223``, ``0.922``), as a whole
  number (``80``, not inside ``180``); an answer that is a whole number below 10 or a
  choice of words is common prose, so for those only the question's own section (from its
  heading) is searched, and a choice's own question cell (which lists the options) is not;
- **after it**: the first code cell with outputs, and every code cell up to the next
  markdown cell, are saved with their outputs collapsed (cell metadata
  ``jupyter.outputs_hidden``, which JupyterLab shows as a bar to click and the site folds),
  and no markdown cell before that first one states the answer.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHECK = re.compile(r"\b(ex\d\d)\.(\w+)\.check\(")
HEADING = re.compile(r"^#{1,3}\s", re.M)


def _source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _outputs(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append("".join(output.get("text", "")))
        for mime, data in output.get("data", {}).items():
            if mime.startswith("text/"):
                parts.append("".join(data) if isinstance(data, list) else data)
    return "\n".join(parts)


def renderings(answer: object) -> list[str]:
    """How a cell or a sentence would write ``answer``."""
    if isinstance(answer, str):
        return [answer]
    x = float(answer)
    if x == int(x):
        return [str(int(x))]
    return sorted({f"{x:g}"} | {f"{x:.{k}g}" for k in range(3, 7)})


def appears(answer: object, text: str) -> bool:
    for form in renderings(answer):
        if isinstance(answer, str):
            if re.search(rf"(?<!\w){re.escape(form)}(?!\w)", text, re.IGNORECASE):
                return True
        elif re.search(rf"(?<![\d.]){re.escape(form)}(?![\d]|\.\d)", text):
            return True
    return False


def common(answer: object) -> bool:
    """A choice of words, or a whole number below 10: looked for in its section only."""
    return isinstance(answer, str) or (float(answer) == int(answer) and abs(answer) < 10)


def predictions(path: Path) -> list[tuple[int, str, object]]:
    """(cell index, exNN.name, answer) for every prediction the notebook asks."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        for module, name in CHECK.findall(_source(cell)):
            exercise = getattr(importlib.import_module(f"accumlab_course.exercises.{module}"), name)
            if exercise.kind == "prediction":
                found.append((i, f"{module}.{name}", exercise.answer))
    return found


def problems(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    out = []
    for q, name, answer in predictions(path):
        start = 0
        if common(answer):
            start = max((i for i in range(q) if cells[i]["cell_type"] == "markdown"
                         and HEADING.search(_source(cells[i]))), default=0)
        question = q - 1
        while question >= 0 and cells[question]["cell_type"] == "markdown":
            question -= 1
        for i in range(start, q):
            cell = cells[i]
            if cell["cell_type"] == "markdown":
                if isinstance(answer, str) and i > question:
                    continue  # the question itself names the options
                if appears(answer, _source(cell)):
                    out.append(f"{name}: the answer {answer!r} is in the markdown of cell {i}, above it")
            elif appears(answer, _outputs(cell)):
                out.append(f"{name}: the answer {answer!r} is in the saved output of cell {i}, above it")
        j = q + 1
        while j < len(cells) and not (cells[j]["cell_type"] == "code" and cells[j].get("outputs")):
            if cells[j]["cell_type"] == "markdown" and appears(answer, _source(cells[j])):
                out.append(f"{name}: the answer is in the markdown of cell {j}, before its reveal")
            j += 1
        while j < len(cells) and cells[j]["cell_type"] == "code":
            if cells[j].get("outputs") and not cells[j]["metadata"].get("jupyter", {}).get("outputs_hidden"):
                out.append(f"{name}: cell {j} reveals the answer with its output in view; save it "
                           "collapsed (metadata jupyter.outputs_hidden)")
            j += 1
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_prediction_is_answered_before_it_is_asked(path):
    assert problems(path) == []


def _notebook(tmp_path: Path, cells: list[dict]) -> Path:
    path = tmp_path / "00_x.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def _md(text: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def _code(text: str, output: str = "", hidden: bool = False) -> dict:
    outputs = [{"output_type": "stream", "name": "stdout", "text": output}] if output else []
    metadata = {"jupyter": {"outputs_hidden": True}} if hidden else {}
    return {"cell_type": "code", "metadata": metadata, "source": text, "outputs": outputs,
            "execution_count": 1}


# ex00.effective_batch's answer is 64 and ex00.update_attempts's is 3 (a common number).
ASK = _code("ex00.effective_batch.check(...)", "not attempted yet")


def test_a_well_made_prediction_passes(tmp_path):
    cells = [_md("## 1. Sizes\nPredict first: the effective batch?"), ASK,
             _code("print(plan)", "effective batch 64", hidden=True), _md("It is 64.")]
    assert problems(_notebook(tmp_path, cells)) == []


@pytest.mark.parametrize(("cells", "found"), [
    ([_code("x", "an update of 64 examples"), _md("## 2\nPredict"), ASK, _code("y", "64", hidden=True)],
     "saved output of cell 0"),
    ([_md("With 64 examples per update ...\n## 2\nPredict"), ASK, _code("y", "64", hidden=True)],
     "markdown of cell 0"),
    ([_md("## 2\nPredict"), ASK, _code("y", "effective batch 64")], "in view"),
    ([_md("## 2\nPredict"), ASK, _md("The answer is 64:"), _code("y", "64", hidden=True)],
     "before its reveal"),
])
def test_each_way_of_giving_the_answer_away_is_found(tmp_path, cells, found):
    assert any(found in p for p in problems(_notebook(tmp_path, cells)))


def test_a_small_number_is_looked_for_in_its_own_section_only(tmp_path):
    ask = _code("ex00.update_attempts.check(...)", "not attempted yet")
    cells = [_md("## 1\nThree ranks, 3 GPUs."), _md("## 2\nPredict the attempts."), ask,
             _code("y", "3 attempts", hidden=True)]
    assert problems(_notebook(tmp_path, cells)) == []
    cells[1] = _md("## 2\nThere are 3 windows. Predict the attempts.")
    assert problems(_notebook(tmp_path, cells))


def test_a_number_is_found_as_a_whole_number_only():
    assert not appears(64, "164 targets, 6.4 s, 64.5 MB")
    assert appears(64, "64 examples")
    assert appears(0.9223300970873787, "applied = 0.9223 x reference")
    assert not appears(0.25, "0.251 and 10.25")
