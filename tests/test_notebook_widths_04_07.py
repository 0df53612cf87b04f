"""Notebooks 04-07 fit the site's narrow column as 00-03 do: code lines at most 88
characters, printed lines at most 100 (the install cell left out), the checkers' lines and
the audit's printed report included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LATER = (
    "04_ddp_no_sync.ipynb",
    "05_memory_instrumentation.ipynb",
    "06_when_equivalence_ends.ipynb",
    "07_capstone.ipynb",
)


@pytest.mark.parametrize("notebook", LATER)
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
