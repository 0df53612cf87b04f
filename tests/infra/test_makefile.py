"""The Makefile's install steps, read through ``make -n`` (prints the commands, runs none).

This machine cannot reach PyTorch's wheel index, so the tests check that the choice of
index reaches pip's command line, not that a download works.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def dry_run(tmp_path: Path, *args: str) -> list[str]:
    """The commands ``make -n`` would run for a fresh virtual environment in tmp_path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_INDEX", "TORCH", "PIPFLAGS", "LAB_ARGS", "LAB_PORT", "MAKEFLAGS")}
    result = subprocess.run(
        ["make", "-n", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}", *args],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )
    return result.stdout.splitlines()


def pip_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if " -m pip install " in line]


def torch_line(lines: list[str]) -> str:
    """The pip line that downloads PyTorch (the first one naming it)."""
    return [line for line in pip_lines(lines) if '"torch==' in line][0]


def test_default_installs_the_pinned_torch_from_pips_own_index(tmp_path):
    lines = dry_run(tmp_path, "lab")
    line = torch_line(lines)
    assert '"torch==2.13.0"' in line and "--index-url" not in line
    # the step says what it installs, and what to do on a Linux machine without a GPU
    (said,) = [line for line in lines if "installing PyTorch 2.13.0" in line]
    assert "TORCH_INDEX=cpu" in said


@pytest.mark.parametrize(
    ("choice", "url"),
    [
        ("cpu", CPU_INDEX),
        ("cu128", "https://download.pytorch.org/whl/cu128"),
        ("https://mirror.example/torch/cpu", "https://mirror.example/torch/cpu"),
    ],
)
def test_torch_index_reaches_pip_for_torch_only(tmp_path, choice, url):
    lines = dry_run(tmp_path, "lab", f"TORCH_INDEX={choice}")
    first = torch_line(lines)
    # PyTorch's index serves torch alone: --no-deps, few retries, a short timeout
    assert f"--index-url {url} " in first and "--no-deps" in first
    assert "--retries 1" in first and "--timeout 20" in first
    # its dependencies, and everything else, come from pip's usual index
    others = [line for line in pip_lines(lines) if line != first]
    assert any('"torch==2.13.0"' in line for line in others)
    assert others and not any("--index-url" in line for line in others)
    (said,) = [line for line in lines if "installing PyTorch 2.13.0" in line]
    assert url in said
    # the index is probed first, so an unreachable one fails in seconds with one line
    (probe,) = [line for line in lines if "tools/reach_index.py" in line]
    assert lines.index(probe) < lines.index(first) and probe.endswith(url)


def test_an_unreachable_index_fails_fast_with_one_line():
    import sys
    import time

    start = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "reach_index.py"),
                             "http://127.0.0.1:9/whl/cpu"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and time.monotonic() - start < 30
    (line,) = result.stderr.splitlines()
    assert line.startswith("cannot reach PyTorch's wheel index http://127.0.0.1:9/whl/cpu")


def test_lab_installs_the_course_and_not_the_test_tools(tmp_path):
    lines = pip_lines(dry_run(tmp_path, "lab"))
    assert any('-e . -e ./course ' in line + " " for line in lines)  # the library and the course
    assert any('-e "./course[lab]"' in line for line in lines)
    assert not any(".[dev" in line or "dev]" in line for line in lines)
    tests = pip_lines(dry_run(tmp_path, "test"))
    assert any('-e ".[dev]" -e ./course' in line for line in tests)
    assert not any(".[lab" in line or "lab]" in line for line in tests)


def test_every_install_step_is_announced_and_pip_is_not_silenced(tmp_path):
    lines = dry_run(tmp_path, "lab")
    for i, line in enumerate(lines):
        if " -m pip install " in line:
            assert lines[i - 1].startswith('echo "installing '), line
            assert not re.search(r"\s-q\b", line)  # pip shows its own progress
    quiet = pip_lines(dry_run(tmp_path, "test", "PIPFLAGS=-q"))
    assert quiet and all(re.search(r"\s-q\b", line) for line in quiet)


def test_lab_serves_the_repository_root_in_the_course_workspace(tmp_path):
    venv = tmp_path / "venv"
    lines = dry_run(tmp_path, "lab", "LAB_PORT=9999", "LAB_ARGS=--no-browser")
    text = "\n".join(lines).replace("\\\n", " ")
    (load,) = [x for x in text.splitlines() if "jupyter lab workspaces import" in x]
    (start,) = [x for x in text.splitlines() if "/jupyter lab " in x and "import" not in x]
    assert text.index(load) < text.index(start)  # the layout is in place before the server
    # the committed layout is copied into the virtual environment under the name the URL
    # opens, so JupyterLab saves the learner's layout there and never into the repository
    assert load.split()[-1] == "tools/lab-workspace.json"
    assert "--name=accumlab " in load
    assert f"--LabWorkspaceImportApp.workspaces_dir={venv}/lab-workspaces " in load
    assert f"--LabApp.workspaces_dir={venv}/lab-workspaces " in start
    assert "--LabApp.default_url=/lab/workspaces/accumlab " in start
    assert "--ServerApp.root_dir=. " in start
    assert "--ServerApp.port=9999" in start and start.endswith("--no-browser")
    # the learner's copies exist before the server opens one of them
    (sync,) = [x for x in text.splitlines() if "tools/learner_copies.py sync" in x]
    assert text.index(sync) < text.index(start)
    # a quiet start: no language-server scan, no news pop-up, no egg-info in the browser
    assert "--LanguageServerManager.autodetect=False" in start and "*.egg-info" in start
    (settings,) = [x for x in text.splitlines() if "lab-overrides.json" in x]
    assert settings.endswith(f"{venv}/share/jupyter/lab/settings/overrides.json")
    overrides = json.loads((ROOT / "tools" / "lab-overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


def _pytest_line(lines: list[str], stage: str) -> str:
    (line,) = [x for x in lines if f'tools/timed "{stage}" ' in x]
    return line


def test_test_runs_the_unit_tests_and_notebooks_in_one_session_over_both_cores(tmp_path):
    lines = dry_run(tmp_path, "test")
    for stage in ('"smoke check"', "lint"):
        assert any(f"tools/timed {stage} " in x for x in lines), stage
    line = _pytest_line(lines, "unit tests and notebooks")
    # one pytest session over two workers (pytest-xdist), a file or notebook whole on one,
    # in the order tests/conftest.py gives (the longest first), the slowest tests listed
    assert " -n 2 --dist loadfile --no-loadscope-reorder --durations=" in line
    notebooks = " ".join(sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("notebooks/[0-9]*.ipynb")))
    assert line.endswith(f'-m "not slow" --nbval tests {notebooks}')
    assert "-m pytest" in line and "OMP_NUM_THREADS=1" in line
    # TEST_JOBS=0: everything in one process
    serial = dry_run(tmp_path, "test", "TEST_JOBS=0")
    assert " -n 0 --dist loadfile " in _pytest_line(serial, "unit tests and notebooks")
    result = subprocess.run(["bash", str(ROOT / "tools" / "timed"), "stage x", "false"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and result.stdout.startswith("== stage x: FAILED (exit 1) in ")


def test_unit_nbval_and_slow_are_the_parts_on_their_own(tmp_path):
    for target, stage, ending in [
        ("unit", "unit tests", '-m "not slow" tests'),
        ("nbval", "notebooks (strict nbval)", "--nbval notebooks/"),
        ("slow", "slow tests", "-m slow tests"),
    ]:
        line = _pytest_line(dry_run(tmp_path, target), stage)
        assert " -n 2 --dist loadfile --no-loadscope-reorder " in line, target
        assert ending in line, target


def test_the_course_workspace_opens_the_learners_notebook_00():
    workspace = json.loads((ROOT / "tools" / "lab-workspace.json").read_text())
    data = workspace["data"]
    # the file browser shows the learner's copies (a path relative to the server's root)
    assert data["file-browser-filebrowser:cwd"] == {"path": "my-notebooks"}
    notebook = "my-notebooks/00_start_here.ipynb"
    layout = data["layout-restorer:data"]
    assert layout["main"]["current"] == f"notebook:{notebook}"
    assert layout["main"]["dock"]["widgets"] == [f"notebook:{notebook}"]
    assert layout["left"] == {"collapsed": False, "current": "filebrowser"}
    assert data[f"notebook:{notebook}"]["data"] == {"path": notebook, "factory": "Notebook"}
    assert (ROOT / "notebooks" / "00_start_here.ipynb").is_file()  # what the copy is made from
    assert "my-notebooks/" in (ROOT / ".gitignore").read_text().splitlines()
    assert workspace["metadata"]["id"] == "accumlab"
    # the line `make lab` prints before starting names the notebook the workspace opens
    makefile = (ROOT / "Makefile").read_text()
    assert "LAB_COPIES := my-notebooks\n" in makefile
    assert "LAB_NOTEBOOK := $(LAB_COPIES)/00_start_here.ipynb\n" in makefile


def test_check_and_test_run_the_smoke_check(tmp_path):
    assert any(line.endswith("accumlab env --check") for line in dry_run(tmp_path, "check"))
    assert any(line.endswith("accumlab env --check") for line in dry_run(tmp_path, "test"))


def test_the_library_needs_torch_and_tqdm_and_the_course_the_rest():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    course = tomllib.loads((ROOT / "course" / "pyproject.toml").read_text())["project"]

    def names(deps):
        return {re.split(r"[<>=!~ \[;]", dep)[0].lower() for dep in deps}

    assert names(project["dependencies"]) == {"torch", "tqdm"}
    assert {"accumlab", "matplotlib", "ipywidgets"} <= names(course["dependencies"])
    # the course requires the library's own release, exactly
    assert f"accumlab=={project['version']}" in course["dependencies"]
    assert course["version"] == project["version"]
    lab = course["optional-dependencies"]["lab"]
    assert any(dep.startswith("jupyterlab") for dep in lab)
    assert "lab" not in project["optional-dependencies"]
    assert not any(dep.startswith(("pytest", "nbval", "ruff", "hypothesis")) for dep in lab)
    dev = project["optional-dependencies"]["dev"]
    assert {"pytest", "nbval", "ruff"} <= {re.split(r"[<>=!~ ]", d)[0] for d in dev}


def test_ci_installs_the_locks_torch_on_disk_and_runs_make_test_then_the_slow_tier():
    script = (ROOT / ".ci" / "run").read_text()
    (install,) = [line for line in script.splitlines() if "pip install" in line]
    assert '"$torch"' in install and "index-url" not in install
    assert install.startswith('tools/timed "install PyTorch" ')
    # $torch is the lock's exact pin, read the way the script reads it
    torch = subprocess.run(["bash", "-c", "grep '^torch==' constraints.txt"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert torch == "torch==2.13.0" and "torch=$(grep '^torch==' constraints.txt)" in script
    # make test first (the README's command), then the slow tier, each stage timed; pip
    # quiet and without byte-compiling at install time
    makes = [line for line in script.splitlines() if line.startswith('tools/timed "make ')]
    assert makes == [
        'tools/timed "make test" make test PIPFLAGS="$pipflags"',
        'tools/timed "make slow" make -j3 --output-sync=target slow PIPFLAGS="$pipflags"',
    ]
    assert 'pipflags="-q --no-compile"' in script
    # modules are compiled on first import, so Python must be let write the bytecode
    assert "\nunset PYTHONDONTWRITEBYTECODE\n" in script
    assert "TORCH_INDEX" not in script  # never PyTorch's index (a CUDA or remote download)


def test_make_site_is_the_build_and_the_check_that_the_slow_tier_runs(tmp_path):
    """.ci/run builds the site once, in the slow tier's
    tests/infra/test_site.py::test_make_site_builds_every_lesson_offline_and_the_check_passes,
    which runs the two scripts `make site` runs, after installing the site tools the
    dev extra holds too."""
    lines = dry_run(tmp_path, "site")
    (install,) = [x for x in pip_lines(lines) if '".[site]"' in x]
    assert '-e ".[site]" -e ./course' in install and "-c constraints.txt" in install
    build = next(i for i, x in enumerate(lines) if "tools/build_site.py" in x)
    check = next(i for i, x in enumerate(lines) if "tools/check_site.py" in x)
    assert lines.index(install) < build < check
    tomllib = pytest.importorskip("tomllib")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert "accumlab[site]" in dev
    source = (ROOT / "tests" / "infra" / "test_site.py").read_text()
    test = source[source.index("@pytest.mark.slow\ndef test_make_site_builds_every_lesson"):]
    assert '"build_site.py"' in test and '"check_site.py"' in test


def test_slow_installs_every_transformers_release_the_version_test_runs(tmp_path):
    """Each release of tests/hf/test_hf_audit_versions.py goes into its own folder, with
    --no-deps and exact releases, inside the ranges that release's own metadata declares,
    of huggingface_hub and tokenizers (datasets 4.0.0, the last that runs on
    huggingface_hub below 1.0). ``make slow`` installs them; ``make unit`` does not."""
    spec = importlib.util.spec_from_file_location("versions", ROOT / "tests/hf/test_hf_audit_versions.py")
    versions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(versions)
    declared = {  # Requires-Dist of each wheel: huggingface_hub, tokenizers
        "4.46.3": (">=0.23.2,<1.0", ">=0.20,<0.21"),
        "4.50.3": (">=0.26.0,<1.0", ">=0.21,<0.22"),
        "4.57.6": (">=0.34,<1.0", ">=0.22,<=0.23.0"),
    }
    assert set(versions.EXPECTED) == set(declared)
    assert not [x for x in pip_lines(dry_run(tmp_path, "unit")) if "transformers==" in x]
    lines = [line for line in pip_lines(dry_run(tmp_path, "slow")) if "transformers==" in line]
    assert len(lines) == len(declared)
    from packaging.specifiers import SpecifierSet

    for release, ranges in declared.items():
        (line,) = [x for x in lines if f'"transformers=={release}"' in x]
        target = tmp_path / "venv" / f"hf-transformers-{release}"
        assert f"--no-deps --target {target} " in line
        assert line.endswith('"datasets==4.0.0"') and "-c constraints.txt" not in line
        hub, tok = (re.search(rf'"{name}==([^"]+)"', line).group(1) for name in ("huggingface_hub", "tokenizers"))
        assert hub in SpecifierSet(ranges[0]) and tok in SpecifierSet(ranges[1]), (release, hub, tok)
