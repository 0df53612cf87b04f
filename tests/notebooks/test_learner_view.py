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


# --- the core path reads without its deep dives ---------------------------------------------

_HEADING = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")


def deep_dive_tails(cells: list[dict]) -> list[str]:
    """Markdown cells that hold the end of a deep dive and then a heading back to the core
    path. A learner on the core path skips the deep dive and starts reading such a cell at
    its top: in the middle of the deep dive's last paragraph. (A heading that begins with
    "Deep dive" starts one; it runs to the next heading of the same or a higher level,
    as tools/course_time.py counts it.)"""
    found, dive = [], None
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        fenced, dive_text = False, False
        for line in _text(cell.get("source")).splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            heading = None if fenced else _HEADING.match(line)
            if heading:
                level, title = len(heading.group(1)), heading.group(2)
                if title.startswith("Deep dive"):
                    if dive is None or level <= dive:
                        dive = level
                elif dive is not None and level <= dive:
                    dive = None
                    if dive_text:
                        found.append(f"cell {i}: opens with a deep dive's last text, then "
                                     f"'{title}'; split it before the heading")
                dive_text = False
            elif line.strip() and dive is not None:
                dive_text = True
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_opens_the_core_path_inside_a_deep_dive(path):
    assert deep_dive_tails(json.loads(path.read_text(encoding="utf-8"))["cells"]) == []


def test_a_deep_dive_tail_before_a_core_heading_is_found():
    md = lambda text: {"cell_type": "markdown", "source": text}  # noqa: E731
    cells = [md("## 1. Core\ntext"), md("### Deep dive: details\nmore"),
             md("The dive's last words.\n\n## 2. Back in the core\ntext")]
    assert deep_dive_tails(cells) == ["cell 2: opens with a deep dive's last text, then "
                                      "'2. Back in the core'; split it before the heading"]
    cells[2] = md("## 2. Back in the core\ntext")  # the tail in a cell of its own
    assert deep_dive_tails(cells) == []
    cells[1] = md("### Deep dive: details\nmore\n\n#### Exercise inside it\nstill the dive")
    cells[2] = md("Core text.\n\n### Deep dive: another\n")  # core text, then a dive: fine
    assert deep_dive_tails(cells) == []
