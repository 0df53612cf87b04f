"""tools/install_cell.py: the first code cell that makes a notebook run where it is opened.

The cell must do nothing (and print nothing) where accumlab is importable, so the
committed notebooks stay stable under strict nbval; elsewhere it installs accumlab from
the repository URL in pyproject.toml, or from ACCUMLAB_INSTALL_SOURCE. The last test
(marked ``packaging``) runs notebook 00 in a fresh virtual environment that has PyTorch
but no accumlab, with a locally built wheel as the install source.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import install_cell as ic
import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"




def _notebook(name: str = "00_start_here.ipynb") -> dict:
    return json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))


def _install_cells(nb: dict) -> list[int]:
    return [i for i, c in enumerate(nb["cells"]) if c.get("id") == ic.CELL_ID]


def _without_install_cell(nb: dict) -> dict:
    """The notebook as its owners committed it (the coordinator may have run the tool)."""
    nb = copy.deepcopy(nb)
    nb["cells"] = [c for c in nb["cells"] if not ic._is_install_cell(c)]
    return nb


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
def test_goes_right_before_the_first_code_cell_and_changes_nothing_else(name):
    original = _without_install_cell(_notebook(name))
    nb = copy.deepcopy(original)
    assert ic.apply(nb, ("accumlab @ git+https://example.org/x/y@main", "accumlab-course==0.1.0")) is True
    (index,) = _install_cells(nb)
    first_code = next(i for i, c in enumerate(original["cells"]) if c["cell_type"] == "code")
    assert index == first_code
    assert nb["cells"][:index] + nb["cells"][index + 1 :] == original["cells"]
    cell = nb["cells"][index]
    assert cell["outputs"] == [] and cell["execution_count"] is None
    assert "".join(cell["source"]).startswith(ic.FIRST_LINE)


def test_running_it_again_changes_nothing():
    nb = _without_install_cell(_notebook())
    ic.apply(nb, ("accumlab==0.1.0", "accumlab-course==0.1.0"))
    once = json.dumps(nb)
    assert ic.apply(nb, ("accumlab==0.1.0", "accumlab-course==0.1.0")) is False
    assert json.dumps(nb) == once


def test_a_stale_cell_is_updated_in_place_not_duplicated():
    nb = _without_install_cell(_notebook())
    ic.apply(nb, ("accumlab @ git+https://github.com/old/name@main", "accumlab-course==0.1.0"))
    (index,) = _install_cells(nb)
    nb["cells"][index]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["x\n"]}]
    assert ic.apply(nb, ("accumlab==9.9.9", "accumlab-course==0.1.0")) is True
    assert _install_cells(nb) == [index]
    source = "".join(nb["cells"][index]["source"])
    assert "accumlab==9.9.9" in source and "old/name" not in source
    # An older cell recognized by its first line (no id yet) is updated the same way.
    del nb["cells"][index]["id"]
    assert ic.apply(nb, ("accumlab==1.0.0", "accumlab-course==0.1.0")) is True and _install_cells(nb) == [index]


def test_two_install_cells_or_a_misplaced_one_are_refused():
    nb = _without_install_cell(_notebook())
    ic.apply(nb, ("accumlab==0.1.0", "accumlab-course==0.1.0"))
    (index,) = _install_cells(nb)
    twice = copy.deepcopy(nb)
    twice["cells"].append(copy.deepcopy(nb["cells"][index]) | {"id": "other"})
    with pytest.raises(ValueError, match="2 install cells"):
        ic.apply(twice, ("accumlab==0.1.0", "accumlab-course==0.1.0"))
    moved = copy.deepcopy(nb)
    moved["cells"].append(moved["cells"].pop(index))
    with pytest.raises(ValueError, match="not the first code cell"):
        ic.apply(moved, ("accumlab==0.1.0", "accumlab-course==0.1.0"))


def test_the_source_comes_from_pyproject_urls(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "accumlab"\nversion = "2.3.4"\n'
        '[project.urls]\nRepository = "https://github.com/someone/fork.git"\n'
    )
    assert ic.install_source(pyproject=pyproject) == (
        "accumlab @ git+https://github.com/someone/fork@main",
        "accumlab-course @ git+https://github.com/someone/fork@main#subdirectory=course")
    assert ic.install_source(release=True, pyproject=pyproject) == ("accumlab==2.3.4", "accumlab-course==2.3.4")
    pyproject.write_text('[project]\nname = "accumlab"\nversion = "1"\n')
    with pytest.raises(Exception, match=r"\[project.urls\] needs Repository"):
        ic.install_source(pyproject=pyproject)
    # The repository's own pyproject names the URL the site and the cell use.
    assert ic.install_source()[0].startswith("accumlab @ git+https://")


def test_the_cell_is_silent_where_accumlab_is_installed(tmp_path):
    # A source that cannot be installed: the cell would fail loudly if it tried.
    code = ic.cell_source(("accumlab @ git+https://example.invalid/none@main", "accumlab-course==0"))
    env = {**os.environ, "ACCUMLAB_INSTALL_SOURCE": str(tmp_path / "missing.whl")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_the_cell_passes_the_projects_ruff_rules():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    proc = subprocess.run(
        [ruff, "check", "--no-cache", "--stdin-filename", "install_cell.py", "-"],
        input=ic.cell_source(ic.install_source()) + "\n", capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_quotes_in_a_source_are_refused():
    with pytest.raises(ValueError, match="quotes"):
        ic.cell_source(("accumlab", 'x"; import os; os.system("true")'))


def test_the_committed_exercise_checks_still_hold_with_the_cell(tmp_path, monkeypatch):
    """tests/helpers/notebook_exercises.py finds cells by content, not position: it accepts the
    notebooks with the install cell inserted."""
    for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        nb = _without_install_cell(json.loads(path.read_text(encoding="utf-8")))
        ic.apply(nb, ic.install_source())
        (tmp_path / path.name).write_text(ic._dump(nb), encoding="utf-8")
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import notebook_exercises

    monkeypatch.setattr(notebook_exercises, "NOTEBOOKS", tmp_path)
    notebook_exercises.assert_unsolved(
        "00_start_here.ipynb", {"accumulation_steps": "ex00", "replicas": "ex00"}
    )
    notebook_exercises.assert_unsolved("01_single_device_loop.ipynb", {"accumulate_from_means": "ex01"})
    notebook_exercises.assert_unsolved("07_capstone.ipynb", {"fixed_window": "ex07"})


def test_the_command_line_writes_once_and_check_reports_staleness(tmp_path):
    target = tmp_path / "00_start_here.ipynb"
    target.write_text(ic._dump(_without_install_cell(_notebook())), encoding="utf-8")
    tool = [sys.executable, str(REPO / "tools" / "install_cell.py")]
    check = subprocess.run([*tool, "--check", str(target)], capture_output=True, text=True)
    assert check.returncode == 1 and "missing or stale" in check.stderr
    assert subprocess.run([*tool, str(target)], capture_output=True).returncode == 0
    written = target.read_bytes()
    assert subprocess.run([*tool, str(target)], capture_output=True).returncode == 0
    assert target.read_bytes() == written
    assert subprocess.run([*tool, "--check", str(target)], capture_output=True).returncode == 0


# --- notebook 00 from a fresh environment, through its install cell -----------------------


def _run(cmd, **kwargs) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


_EXECUTE = """
import json, sys
import nbclient, nbformat
nb = nbformat.read(sys.argv[1], as_version=4)
client = nbclient.NotebookClient(
    nb, kernel_name="accumlab-fresh", timeout=900,
    resources={"metadata": {"path": sys.argv[2]}},
    extra_arguments=["--IPKernelApp.capture_fd_output=False"],
)
client.execute()
nbformat.write(nb, sys.argv[3])
"""


@pytest.mark.packaging
@pytest.mark.slow
def test_notebook_00_runs_in_a_fresh_environment_through_its_install_cell(tmp_path):
    """A fresh venv with PyTorch 2.13.0 and a Jupyter kernel (what a hosted service has)
    but no accumlab; the install cell installs a wheel built from this tree (offered with
    ACCUMLAB_INSTALL_SOURCE, so no repository URL is needed) and the notebook runs to the
    end. The notebook sits in notebooks/ beside a copy of the Makefile, as in a clone:
    notebook 00 reads ../Makefile in its section on the make targets."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TQDM_DISABLE="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg", PYTHONHASHSEED="0")

    src, dist = tmp_path / "src", tmp_path / "dist"
    ignore = shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", "runs", "site",
        ".hypothesis", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints",
    )  # fmt: skip
    shutil.copytree(REPO, src, ignore=ignore)
    for project in (src, src / "course"):
        _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, project],
             env=env, timeout=300)
    (wheel,) = dist.glob("accumlab-*.whl")
    (course_wheel,) = dist.glob("accumlab_course-*.whl")

    venv = tmp_path / "fresh"
    _run([sys.executable, "-m", "venv", venv], env=env, timeout=300)
    python = venv / "bin" / "python"
    # --no-compile: byte-compiling all of PyTorch at install time is most of this step's CPU
    # time (24 s of 34); the modules the notebook imports are compiled when first imported.
    _run([python, "-m", "pip", "install", "--quiet", "--no-compile", "torch==2.13.0", "ipykernel"],
         env=env, timeout=900)
    probe = _run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('accumlab'), u.find_spec('accumlab_course'))"],
        env=env, cwd=tmp_path,
    )
    assert probe.stdout.strip() == "None None"  # neither before the notebook runs
    jupyter = tmp_path / "jupyter"
    _run([python, "-m", "ipykernel", "install", "--prefix", jupyter, "--name", "accumlab-fresh"], env=env)

    checkout = tmp_path / "checkout"
    (checkout / "notebooks").mkdir(parents=True)
    shutil.copy(REPO / "Makefile", checkout / "Makefile")
    nb = _without_install_cell(_notebook())
    ic.apply(nb, ic.install_source())
    notebook = checkout / "notebooks" / "00_start_here.ipynb"
    notebook.write_text(ic._dump(nb), encoding="utf-8")

    env.update(JUPYTER_PATH=str(jupyter / "share" / "jupyter"), ACCUMLAB_INSTALL_SOURCE=os.pathsep.join([str(wheel), str(course_wheel)]))
    executed = tmp_path / "executed.ipynb"
    _run([sys.executable, "-c", _EXECUTE, notebook, notebook.parent, executed], env=env, cwd=tmp_path, timeout=1200)

    result = json.loads(executed.read_text(encoding="utf-8"))
    code = [c for c in result["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code)  # every cell ran
    errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert errors == []
    install_text = "".join("".join(o.get("text", "")) for o in code[0]["outputs"])
    assert f"installing accumlab and the course from {wheel}, {course_wheel}" in install_text
    where = _run([python, "-c", "import accumlab; print(accumlab.__file__)"], env=env, cwd=tmp_path).stdout
    assert Path(where.strip()).is_relative_to(venv)  # the wheel's copy, not this checkout
    # The saved outputs of the committed notebook's checks came out the same.
    committed = [c for c in _without_install_cell(_notebook())["cells"] if c["cell_type"] == "code"]
    for before, after in zip(committed, code[1:], strict=True):
        if "nbval-ignore-output" in before.get("metadata", {}).get("tags", []):
            continue
        assert _stream(after) == _stream(before), "".join(before["source"])[:200]


def _stream(cell: dict) -> str:
    return "".join("".join(o["text"]) for o in cell["outputs"] if o["output_type"] == "stream")
