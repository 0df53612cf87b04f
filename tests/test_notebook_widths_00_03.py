"""Notebooks 00-03 fit the site's narrow column: code lines at most 88 characters, printed
lines at most 100 (the first cell, the install cell shared by every notebook, and a
widget's text form are left out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
MINE = (
    "00_start_here.ipynb",
    "01_single_device_loop.ipynb",
    "02_token_weighting.ipynb",
    "03_amp_gradscaler.ipynb",
)


@pytest.mark.parametrize("notebook", MINE)
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
