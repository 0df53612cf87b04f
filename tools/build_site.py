"""Build the course site: a static HTML book of the committed notebooks, without running them.

    .venv/bin/python tools/build_site.py            # build/site-src -> site/ (what `make site` runs first)

Steps: assemble the Sphinx sources in build/site-src/ (docs/site's pages, a copy of every
notebook in notebooks/ and of docs/ARCHITECTURE.md and docs/WORKSHOP.md), then run
``sphinx-build -W --keep-going`` into site/. Nothing is executed and nothing in the
repository is written except site/ and build/ (both git-ignored). While copying:

- each lesson gets a "Run this notebook" box under its title: locally (``make lab``) or in
  a hosted notebook service, with links built from the repository URL in pyproject.toml's
  ``[project.urls]``; the lessons that teach the reference loop link to its page;
- a relative link to a file that is a page of the site points to that page, a link to any
  other file of the repository points to it on the repository host, and a link to a file
  that does not exist stops the build;
- the landing page's lesson table is made from README.md's course table (what each
  lesson teaches) and docs/WORKSHOP.md's measured run-all time per notebook.

tools/check_site.py then checks the built site (`make site` runs both).
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
SITE_SOURCES = REPO / "docs" / "site"  # conf.py, the landing page, the reference pages
BUILD_SRC = REPO / "build" / "site-src"  # what Sphinx reads (assembled here)
DOCTREES = REPO / "build" / "site-doctrees"
OUT = REPO / "site"
BRANCH = "main"  # the branch the hosted services open
LESSONS_DIR = "lessons"
# The lessons that teach accumulate and train_window link to the reference loop's page.
TEACHES_LOOP = ("01_single_device_loop", "03_amp_gradscaler")
LOOP_PAGE = "reference/loop.md"
INSTALL_CELL_ID = "accumlab-install"  # tools/install_cell.py's CELL_ID
DOC_PAGES = {"docs/ARCHITECTURE.md": "docs/architecture.md", "docs/WORKSHOP.md": "docs/workshop.md"}
_MD_LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


class SiteError(RuntimeError):
    """The sources cannot make a correct site (a broken link, a missing table, ...)."""


def project_urls(pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    """pyproject.toml's ``[project.urls]``; ``Repository`` must be an https URL."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    urls = dict(data.get("project", {}).get("urls", {}))
    repo = urls.get("Repository", "")
    if not repo.startswith("https://"):
        raise SiteError(f"{pyproject}: [project.urls] needs Repository = 'https://...', got {repo!r}")
    urls["Repository"] = repo.rstrip("/").removesuffix(".git")
    return urls


def hosted_links(repository: str, notebook: str, ref: str = BRANCH) -> dict[str, str]:
    """Links that open ``notebooks/<notebook>`` of a GitHub repository in hosted services."""
    match = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+)", repository)
    if not match:
        raise SiteError(f"hosted-notebook links need a github.com repository URL, got {repository!r}")
    owner, name = match.groups()
    path = f"notebooks/{notebook}"
    return {
        "Colab": f"https://colab.research.google.com/github/{owner}/{name}/blob/{ref}/{path}",
        "Binder": f"https://mybinder.org/v2/gh/{owner}/{name}/{ref}?labpath={quote(path, safe='')}",
    }


def lesson_notebooks() -> list[Path]:
    """The course's notebooks, in order (notebooks/NN_*.ipynb)."""
    found = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise SiteError("no notebooks/NN_*.ipynb found")
    return found


def notebook_title(nb: dict) -> str:
    """The first Markdown heading of a notebook, without its '#'."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    raise SiteError("a notebook has no '# title' heading in its Markdown")


def _table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table after ``heading``; header row first."""
    lines = markdown.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    except StopIteration:
        raise SiteError(f"heading {heading!r} not found") from None
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                rows.append(cells)
        elif rows or line.startswith("#"):
            break
    if len(rows) < 2:
        raise SiteError(f"no table under {heading!r}")
    return rows


def course_rows(readme: str) -> dict[str, list[str]]:
    """README.md's course table: {notebook stem: [its other cells]}, plus '' for the header."""
    rows = _table_rows(readme, "## The course")
    table = {"": rows[0][1:]}
    for cells in rows[1:]:
        table[cells[0].strip("`")] = cells[1:]
    return table


def quick_start(readme: str) -> str:
    """The first fenced code block under README.md's '## Quick start' (the commands)."""
    section = readme.partition("\n## Quick start\n")[2]
    match = re.search(r"^```\w*\n.*?^```$", section, re.DOTALL | re.MULTILINE)
    if not section or not match:
        raise SiteError("README.md has no code block under '## Quick start'")
    return match.group(0)


def run_all_times(workshop: str) -> dict[str, str]:
    """docs/WORKSHOP.md's run-all table: {two-digit notebook number: first wall time}."""
    times = {}
    for cells in _table_rows(workshop, "## Run-all time per notebook")[1:]:
        number = re.match(r"(\d\d) ", cells[0])
        if number:
            times[number.group(1)] = cells[1].split("/")[0].strip().replace(" ", "\u00a0")  # 3.8 s on one line
    return times


def course_table(stems: list[str], titles: dict[str, str]) -> str:
    """The landing page's table of the lessons (Markdown)."""
    readme = course_rows((REPO / "README.md").read_text(encoding="utf-8"))
    times = run_all_times((REPO / "docs" / "WORKSHOP.md").read_text(encoding="utf-8"))
    missing = [s for s in stems if s not in readme or s[:2] not in times]
    if missing:
        raise SiteError(
            f"README.md's course table or docs/WORKSHOP.md's run-all table lacks {missing}"
        )
    header = ["lesson", *readme[""], "run all"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for stem in stems:
        link = f"[{titles[stem]}]({LESSONS_DIR}/{stem}.ipynb)"
        lines.append("| " + " | ".join([link, *readme[stem], times[stem[:2]]]) + " |")
    return "\n".join(lines)


def rewrite_links(markdown: str, origin: str, dest: str, pages: dict[str, str], repository: str) -> str:
    """Rewrite relative links of ``markdown`` (a file at repository path ``origin``, shown
    at site path ``dest``): to the page a file became (``pages``: repository path -> site
    path), else to the file on the repository host. A missing target raises SiteError."""

    def fix(match: re.Match[str]) -> str:
        label, target = match.groups()
        if _SCHEME.match(target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(origin), path))
        if resolved.startswith("../") or not (REPO / resolved).exists():
            raise SiteError(f"{origin}: the link {target!r} points to a missing file {resolved!r}")
        if resolved in pages:
            new = posixpath.relpath(pages[resolved], posixpath.dirname(dest) or ".")
        else:
            kind = "tree" if (REPO / resolved).is_dir() else "blob"
            new = f"{repository}/{kind}/{BRANCH}/{resolved}"
        return f"{label}({new}{'#' + anchor if anchor else ''})"

    return _MD_LINK.sub(fix, markdown)


def run_box(stem: str, repository: str, install_cell: bool = True) -> str:
    """The "Run this notebook" box a lesson page shows under its title (MyST Markdown).
    ``install_cell``: whether the notebook starts with tools/install_cell.py's cell."""
    links = hosted_links(repository, f"{stem}.ipynb")
    hosted = " · ".join(f"[open in {name}]({url})" for name, url in links.items())
    if install_cell:
        how = "The first code cell installs accumlab there; where accumlab is installed it does nothing."
    else:
        how = f'Install accumlab there first: `%pip install "accumlab @ git+{repository}@{BRANCH}"`.'

    lines = [
        ":::{admonition} Run this notebook",
        ":class: tip run-this-notebook",
        f"- **On your machine**: `make lab` in a clone of the [repository]({repository}) "
        "opens JupyterLab ([run it locally](../index.md#run-it-locally)); this lesson is your "
        f"own copy, `my-notebooks/{stem}.ipynb`.",
        f"- **In a hosted notebook service**: {hosted}. {how}",
    ]
    if stem in TEACHES_LOOP:
        lines.append(
            f"- **The reference loop**: `accumulate` and `train_window`, which this lesson "
            f"teaches, in full: [the reference loop](../{LOOP_PAGE})."
        )
    lines.append(":::")
    return "\n".join(lines)


def _lesson(path: Path, pages: dict[str, str], repository: str) -> dict:
    nb = json.loads(path.read_text(encoding="utf-8"))
    origin, dest = f"notebooks/{path.name}", pages[f"notebooks/{path.name}"]
    if path.stem in TEACHES_LOOP:
        text = "".join("".join(c["source"]) for c in nb["cells"])
        if "train_window" not in text and "accumulate" not in text:
            raise SiteError(f"{origin} is listed in TEACHES_LOOP but never names train_window")
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            source = rewrite_links("".join(cell["source"]), origin, dest, pages, repository)
            cell["source"] = source
    # The box goes right under the title: the first Markdown cell is split after its
    # '# ' line (the title alone, the box, then the rest of that cell).
    first = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown")
    lines = nb["cells"][first]["source"].splitlines(keepends=True)
    title = next((n for n, line in enumerate(lines) if line.startswith("# ")), 0)
    head, rest = "".join(lines[: title + 1]), "".join(lines[title + 1 :])
    nb["cells"][first]["source"] = head
    has_cell = any(c.get("id") == INSTALL_CELL_ID for c in nb["cells"])
    source = run_box(path.stem, repository, install_cell=has_cell)
    box = {"cell_type": "markdown", "id": "run-this-notebook", "metadata": {}, "source": source}
    new = [box]
    if rest.strip():
        new.append({"cell_type": "markdown", "id": "after-the-title", "metadata": {}, "source": rest})
    nb["cells"][first + 1 : first + 1] = new
    return nb


def api_entries() -> str:
    """autodoc directives for every name in accumlab.__all__ (classes, functions, the rest)."""
    sys.path.insert(0, str(REPO))
    import inspect

    import accumlab

    classes, functions, others = [], [], []
    for name in accumlab.__all__:
        obj = getattr(accumlab, name)
        if inspect.isclass(obj):
            classes.append(f".. autoclass:: accumlab.{name}\n   :members:\n")
        elif inspect.isfunction(obj):
            functions.append(f".. autofunction:: accumlab.{name}\n")
        elif inspect.ismodule(obj):
            others.append(f".. automodule:: accumlab.{name}\n   :no-members:\n")
        else:
            others.append(f".. py:data:: accumlab.{name}\n   :value: {obj!r}\n")

    def section(title: str, entries: list[str]) -> str:
        return f"## {title}\n\n```{{eval-rst}}\n" + "\n".join(entries) + "```\n"

    return "\n".join(
        [section("Classes", classes), section("Functions", functions), section("Constants and modules", others)]
    )


def assemble(dest: Path = BUILD_SRC) -> list[str]:
    """Write the Sphinx sources into ``dest`` (emptied first); returns the lesson stems."""
    repository = project_urls()["Repository"]
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(SITE_SOURCES, dest, ignore=shutil.ignore_patterns("conf.py", "_ext", "__pycache__"))
    notebooks = lesson_notebooks()
    stems = [p.stem for p in notebooks]
    pages = {f"notebooks/{p.name}": f"{LESSONS_DIR}/{p.name}" for p in notebooks}
    pages.update(DOC_PAGES)
    pages["accumlab/loop.py"] = LOOP_PAGE
    pages["README.md"] = "index.md"

    (dest / LESSONS_DIR).mkdir()
    titles = {}
    for path in notebooks:
        nb = _lesson(path, pages, repository)
        titles[path.stem] = notebook_title(nb)
        (dest / LESSONS_DIR / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False), encoding="utf-8")
    for origin, page in DOC_PAGES.items():
        text = (REPO / origin).read_text(encoding="utf-8")
        (dest / page).parent.mkdir(parents=True, exist_ok=True)
        (dest / page).write_text(rewrite_links(text, origin, page, pages, repository), encoding="utf-8")

    index = (dest / "index.md").read_text(encoding="utf-8")
    index = index.replace("{{COURSE_TABLE}}", course_table(stems, titles))
    index = index.replace("{{LESSON_ENTRIES}}", "\n".join(f"{LESSONS_DIR}/{s}" for s in stems))
    index = index.replace("{{QUICK_START}}", quick_start((REPO / "README.md").read_text(encoding="utf-8")))
    (dest / "index.md").write_text(index, encoding="utf-8")
    loop = dest / LOOP_PAGE  # literalinclude reads the package's own file, wherever dest is
    relative = Path(os.path.relpath(REPO / "accumlab" / "loop.py", loop.parent)).as_posix()
    loop.write_text(loop.read_text(encoding="utf-8").replace("{{LOOP_PY}}", relative), encoding="utf-8")
    api = dest / "reference" / "api.md"
    api.write_text(api.read_text(encoding="utf-8").replace("{{API_ENTRIES}}", api_entries()), encoding="utf-8")
    leftover = [str(p.relative_to(dest)) for p in dest.rglob("*.md") if "{{" in p.read_text(encoding="utf-8")]
    if leftover:
        raise SiteError(f"unfilled placeholders in {leftover}")
    return stems


def build(out: Path = OUT, work: Path | None = None, quiet: bool = True) -> float:
    """Assemble the sources and run Sphinx (warnings are errors); returns seconds taken.
    ``work`` holds the sources and Sphinx's cache (default: build/site-src, build/site-doctrees)."""
    start = time.perf_counter()
    src, doctrees = (BUILD_SRC, DOCTREES) if work is None else (work / "src", work / "doctrees")
    # Sphinx writes into html/ inside the work folder, then the result is copied to `out`:
    # myst-nb puts its image folder (jupyter_execute/) beside Sphinx's output folder, which
    # must not be the repository root.
    html = doctrees.parent / "site-html" / "html"
    assemble(src)
    for stale in (out, doctrees, html.parent):
        if stale.exists():
            shutil.rmtree(stale)
    cmd = [
        sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-E",
        "-c", str(SITE_SOURCES), "-d", str(doctrees), str(src), str(html),
    ]  # fmt: skip
    if quiet:
        cmd.insert(3, "-q")
    subprocess.run(cmd, check=True)
    shutil.copytree(html, out)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where the HTML goes (default: site/)")
    parser.add_argument("--work", type=Path, default=None, help="sources and cache (default: build/)")
    parser.add_argument("--verbose", action="store_true", help="Sphinx's progress, not only warnings")
    args = parser.parse_args(argv)
    try:
        seconds = build(args.out, args.work, quiet=not args.verbose)
    except SiteError as err:
        print(f"build_site: {err}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as err:
        print(f"build_site: sphinx-build failed (exit {err.returncode}); see the warnings above", file=sys.stderr)
        return 1
    print(f"site built in {seconds:.0f} s: {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
