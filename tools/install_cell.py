"""Put the install cell first among a notebook's code cells, so it runs wherever it is opened.

    .venv/bin/python tools/install_cell.py notebooks/*.ipynb          # insert, or update in place
    .venv/bin/python tools/install_cell.py --check notebooks/*.ipynb  # exit 1 if one lacks it or is stale

The cell does nothing where the course is importable (this repository's .venv, CI, a
machine that installed it: ``importlib.util.find_spec("accumlab_course")``, without
importing it), and prints nothing there, so its saved output is empty and stable under
nbval. Elsewhere (a hosted notebook service, a bare Jupyter) it pip-installs the library
and the course (``accumlab`` and ``accumlab-course``, from ``course/``) into the kernel's
environment, from the repository URL in pyproject.toml's ``[project.urls]`` (``--release``
pins the released versions from PyPI instead), and installs PyTorch's CPU build first
where no PyTorch is installed (a plain ``pip install torch`` on Linux downloads gigabytes
of CUDA libraries). ``ACCUMLAB_INSTALL_SOURCE`` in the kernel's environment replaces the
sources (wheel files, directories or pip requirements, separated by ``os.pathsep``): the
tests install locally built wheels that way.

Running the tool again replaces the cell's source with the current one (found by its id
or its first line), never adds a second one. Only the cell's source is written: outputs,
execution counts and the other cells are left as they are (re-execute the notebooks
afterwards with `make notebooks`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from build_site import BRANCH, INSTALL_CELL_ID, project_urls, tomllib  # noqa: E402

CELL_ID = INSTALL_CELL_ID  # the site's run box says "the first code cell installs" when present
FIRST_LINE = "# Runs anywhere: installs the course where it is missing; silent where it is installed."
TORCH_CPU = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU build, ~190 MB

_TEMPLATE = '''{first_line}
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("accumlab_course") is None:  # a hosted service, a bare Jupyter
    given = os.environ.get("ACCUMLAB_INSTALL_SOURCE")
    sources = given.split(os.pathsep) if given else [
        "{library}",
        "{course}",
    ]
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    if importlib.util.find_spec("torch") is None:
        print("installing PyTorch 2.13.0, CPU build ...")
        cpu = "{torch}"
        subprocess.run(pip + ["torch==2.13.0", "--index-url", cpu], check=True)
    print(f"installing accumlab and the course from {{', '.join(sources)}} ...")
    subprocess.run(pip + sources, check=True)
    importlib.invalidate_caches()'''


def install_source(release: bool = False, pyproject: Path = REPO / "pyproject.toml") -> tuple[str, str]:
    """What the cell installs, the library and the course: ``accumlab @ git+<Repository>@<branch>``
    and ``accumlab-course @ git+<Repository>@<branch>#subdirectory=course``, or with
    ``release`` the pinned version of pyproject.toml of each from the package index."""
    if release:
        version = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
        return f"accumlab=={version}", f"accumlab-course=={version}"
    url = f"git+{project_urls(pyproject)['Repository']}@{BRANCH}"
    return f"accumlab @ {url}", f"accumlab-course @ {url}#subdirectory=course"


def cell_source(source: tuple[str, str]) -> str:
    """The install cell's code, installing the library and the course from ``source``."""
    for one in source:
        if '"' in one or "\\" in one:
            raise ValueError(f"an install source must not hold quotes or backslashes, got {one!r}")
    library, course = source
    return _TEMPLATE.format(first_line=FIRST_LINE, library=library, course=course, torch=TORCH_CPU)


def _is_install_cell(cell: dict) -> bool:
    text = "".join(cell.get("source", ""))
    return cell.get("id") == CELL_ID or text.startswith(FIRST_LINE.split(";")[0])


def apply(nb: dict, source: tuple[str, str]) -> bool:
    """Insert or update the install cell of notebook ``nb`` (a dict as json.load gives);
    returns whether ``nb`` changed. It goes right before the first code cell."""
    if nb.get("nbformat", 0) < 4:
        raise ValueError("install_cell handles nbformat 4 notebooks only")
    code = cell_source(source)
    cells = nb["cells"]
    found = [i for i, c in enumerate(cells) if _is_install_cell(c)]
    if len(found) > 1:
        raise ValueError(f"the notebook holds {len(found)} install cells (cells {found}); keep one")
    if found:
        cell = cells[found[0]]
        first_code = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
        if found[0] != first_code:
            raise ValueError(f"the install cell is cell {found[0]}, not the first code cell ({first_code})")
        if "".join(cell["source"]) == code and cell.get("id") == CELL_ID:
            return False
        cell["source"], cell["id"] = code.splitlines(keepends=True), CELL_ID
        return True
    first_code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), len(cells))
    new = {
        "cell_type": "code",
        "execution_count": None,
        "id": CELL_ID,
        "metadata": {},
        "outputs": [],
        "source": code.splitlines(keepends=True),
    }
    if nb.get("nbformat_minor", 0) < 5:
        del new["id"]
    cells.insert(first_code, new)
    return True


def _dump(nb: dict) -> str:
    """The notebook as nbformat writes it (indent 1, sorted keys, sources as lists of lines),
    so a notebook the tool touches differs only in the install cell."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--release", action="store_true", help="install the released version from PyPI")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs it")
    args = parser.parse_args(argv)
    source = install_source(args.release)
    stale = []
    for path in args.notebooks:
        nb = json.loads(path.read_text(encoding="utf-8"))
        try:
            changed = apply(nb, source)
        except ValueError as err:
            print(f"install_cell: {path}: {err}", file=sys.stderr)
            return 1
        if changed and args.check:
            stale.append(path)
        elif changed:
            path.write_text(_dump(nb), encoding="utf-8")
            print(f"install_cell: {path}: install cell written")
    for path in stale:
        print(f"install_cell: {path}: the install cell is missing or stale", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
