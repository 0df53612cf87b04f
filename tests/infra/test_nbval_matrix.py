"""tools/nbval_matrix.py finds the cells whose saved output depends on the CPU kernels."""

from __future__ import annotations

import itertools
from pathlib import Path

import nbformat
import nbval_matrix as matrix
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_pairs_meet_every_two_levels_of_every_two_factors():
    runs = matrix.configs("pairs")
    assert len(runs) == 4
    assert runs[0].settings == {"ATEN_CPU_CAPABILITY": None, "ONEDNN_MAX_CPU_ISA": None,
                                "OMP_NUM_THREADS": "1"}  # the machine's best, as make test runs
    names = [name for name, _ in matrix.FACTORS]
    for a, b in itertools.combinations(names, 2):
        seen = {(r.settings[a], r.settings[b]) for r in runs}
        levels = dict(matrix.FACTORS)
        assert seen == set(itertools.product(levels[a], levels[b])), (a, b)
    full = matrix.configs("full")
    assert len({r.name for r in full}) == 8
    with pytest.raises(ValueError, match="pairs' or 'full'"):
        matrix.configs("some")


def test_a_config_sets_and_removes_variables():
    config = matrix.Config({"ATEN_CPU_CAPABILITY": None, "ONEDNN_MAX_CPU_ISA": "SSE41"})
    env = config.environment({"ATEN_CPU_CAPABILITY": "avx2", "PATH": "/bin"})
    assert env == {"ONEDNN_MAX_CPU_ISA": "SSE41", "PATH": "/bin"}
    assert config.name == "ATEN_CPU_CAPABILITY=best ONEDNN_MAX_CPU_ISA=SSE41"


def test_parse_junit_reads_passes_and_failures(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="notebooks.x" file="notebooks/07_capstone.ipynb" name="Cell 1"/>'
        '<testcase file="notebooks/07_capstone.ipynb" name="Cell 11">'
        '<failure message="Notebook cell execution failed&#10;more">details</failure></testcase>'
        '<testcase file="notebooks/07_capstone.ipynb" name="Cell 12"><skipped/></testcase>'
        '</testsuite></testsuites>')
    assert matrix.parse_junit(report) == {
        "07_capstone.ipynb::Cell 1": "passed",
        "07_capstone.ipynb::Cell 11": "Notebook cell execution failed",
    }


@pytest.mark.slow  # four pytest sessions, four kernels and four PyTorch imports: 22 CPU s
def test_the_tool_names_the_cell_that_depends_on_a_kernel_choice(tmp_path, capsys):
    # A notebook whose second cell prints the oneDNN cap: saved as on a machine without it.
    nb = nbformat.v4.new_notebook()
    steady = nbformat.v4.new_code_cell("print(6 * 7)", execution_count=1)
    steady.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
    moving = nbformat.v4.new_code_cell(
        "import os\nprint(os.environ.get('ONEDNN_MAX_CPU_ISA', 'best'))", execution_count=2)
    moving.outputs = [nbformat.v4.new_output("stream", name="stdout", text="best\n")]
    nb.cells = [steady, moving]
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    status = matrix.main([str(path), "--jobs", "2"])
    out = capsys.readouterr().out
    assert status == 1
    assert "1 cell(s) failed under some run:" in out
    assert "probe.ipynb::Cell 1: depends on the machine" in out  # nbval counts cells from 0
    failing = [x for x in out.splitlines() if x.strip().startswith("under ")]
    assert len(failing) == 2 and all("ONEDNN_MAX_CPU_ISA=SSE41" in x for x in failing)
    assert "probe.ipynb::Cell 0" not in out
