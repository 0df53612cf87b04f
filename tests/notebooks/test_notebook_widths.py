"""Every lesson fits the site's narrow column: code lines at most 88 characters, printed
lines at most 100 (the install cell shared by every notebook is left out), the checkers'
lines and the audit's printed report included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("notebook", LESSONS)
def test_code_and_printed_lines_fit(notebook: str) -> None:
    cells = json.loads((NOTEBOOKS / notebook).read_text(encoding="utf-8"))["cells"]
    too_wide = []
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.startswith("# Runs anywhere: installs"):
            continue
        too_wide += [(i, "code", line) for line in source.splitlines() if len(line) > 88]
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", ""))  # streams: what the cell printed
            too_wide += [(i, "printed", line) for line in text.splitlines() if len(line) > 100]
    assert not too_wide, too_wide
