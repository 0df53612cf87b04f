"""What a learner sees holds no test machinery: nbval's markers live in cell tags (which
nbval reads), and no cell or saved output talks about nbval, reads the Makefile, names a
path under ``tests/``, a CPU-kernel setting or a build path of PyTorch's CI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))

#: (what, pattern, where: "source", "output" or "both")
MACHINERY = [
    ("an nbval marker or a word about nbval", re.compile(r"nbval", re.IGNORECASE), "both"),
    ("a cell that reads the Makefile", re.compile(r"Makefile"), "code"),
    ("a path of the test suite", re.compile(r"(?<![\w/])tests/"), "both"),
    ("a CPU-kernel setting", re.compile(r"ATEN_CPU_CAPABILITY|ONEDNN_MAX_CPU_ISA|oneDNN|AVX-?512|AMX"), "both"),
    ("a build path of PyTorch's CI", re.compile(r"/pytorch/|/__w/|/opt/conda|aten/src"), "output"),
    ("a source file and line of a warning", re.compile(r"\w\.py:\d+: \w*Warning"), "output"),
]


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def findings(cells: list[dict]) -> list[str]:
    found = []
    for i, cell in enumerate(cells):
        source = _text(cell.get("source"))
        outputs = "\n".join(
            _text(o.get("text")) + "".join(_text(v) for k, v in o.get("data", {}).items() if k.startswith("text/"))
            for o in cell.get("outputs", [])
        )
        for what, pattern, where in MACHINERY:
            places = {"both": [source, outputs], "output": [outputs],
                      "code": [source] if cell["cell_type"] == "code" else []}[where]
            if any(pattern.search(text) for text in places):
                found.append(f"cell {i}: {what}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_test_machinery_in_a_learners_view(path):
    assert findings(json.loads(path.read_text(encoding="utf-8"))["cells"]) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_volatile_cells_are_tagged_not_commented(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    tags = {t for c in cells for t in c.get("metadata", {}).get("tags", [])}
    assert tags <= {"nbval-ignore-output", "nbval-skip", "hide-input", "remove-input"}, tags


@pytest.mark.parametrize(("source", "output", "what"), [
    ("# NBVAL_IGNORE_OUTPUT\nprint(1)", "", "nbval"),
    ("text = Path('../Makefile').read_text()", "", "Makefile"),
    ("print(1)", "see tests/core/test_loop.py", "test suite"),
    ("print(1)", "/pytorch/aten/src/ATen/native/x.cpp:12: UserWarning", "CI"),
    ("print(1)", "loop.py:40: UserWarning: clip", "warning"),
])
def test_each_kind_of_machinery_is_found(source, output, what):
    cell = {"cell_type": "code", "source": source,
            "outputs": [{"output_type": "stream", "name": "stderr", "text": output}]}
    assert any(what.lower() in f.lower() for f in findings([cell]))
