"""tools/time_notebooks.py: timing never rewrites the notebook, and --no-processes finds
exactly the cells that need a process (the workshop's fallback list for notebook 04)."""

from __future__ import annotations

import importlib
from pathlib import Path

import nbformat
import pytest


@pytest.fixture(scope="module")
def tool():
    return importlib.import_module("time_notebooks")


def _notebook(path: Path, cells: list[tuple[str, str]]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
        for kind, src in cells
    ]
    nbformat.write(nb, path)
    return path


def test_last_heading_ignores_comment_lines_in_code_fences(tool):
    text = "## 5. Under torchrun\n\n```bash\n# machine 0 runs this\ntorchrun ...\n```\n"
    assert tool._last_heading(text) == "5. Under torchrun"
    assert tool._last_heading("no heading here") is None


def test_timing_leaves_the_notebook_file_unchanged(tool, tmp_path):
    path = _notebook(tmp_path / "nb.ipynb", [("code", "total = sum(i * i for i in range(200_000))")])
    before = path.read_bytes()
    wall, cpu, executed = tool.run_notebook(path, timeout=120)
    assert path.read_bytes() == before  # no outputs written back
    assert executed.cells[0].outputs == [] and executed.cells[0].execution_count == 1
    assert wall > 0 and cpu > 0


def test_no_processes_lists_exactly_the_cells_that_start_a_process(tool, tmp_path):
    path = _notebook(
        tmp_path / "nb.ipynb",
        [
            ("md", "## 1. Plain Python"),
            ("code", "x = 2 + 2"),
            ("md", "## 2. Processes"),
            ("code", "import multiprocessing as mp\np = mp.get_context('spawn').Process(target=print)\np.start()"),
            ("code", "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'])"),
            ("code", "print(p.pid)"),  # runs: p exists, it just never started
            ("code", "y = undefined_name"),
        ],
    )
    _, _, executed = tool.run_notebook(path, timeout=120, no_processes=True)
    assert tool.failed_cells(executed) == [
        (3, "2. Processes", "OSError"),
        (4, "2. Processes", "OSError"),
        (6, "2. Processes", "NameError"),
    ]
