"""Notebook 08 installs what pyproject's ``hf`` extra requires: the same packages, the same
oldest releases (the lesson's outputs hold from those releases on), so a learner's
environment and ``pip install "accumlab[hf]"`` cannot disagree."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _install_cell_needs() -> dict[str, str]:
    cells = json.loads((REPO / "notebooks" / "08_audit_your_job.ipynb").read_text())["cells"]
    (source,) = [
        "".join(c["source"]) for c in cells if "needed = {" in "".join(c.get("source", ""))
    ]
    needed = ast.literal_eval(re.search(r"^needed = (\{.*\})$", source, re.M).group(1))
    return {name: f"{name}>={a}.{b}" for name, (a, b) in needed.items()}


def test_the_install_cell_asks_for_what_the_hf_extra_requires():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["hf"]
    assert sorted(extra) == sorted(_install_cell_needs().values())
