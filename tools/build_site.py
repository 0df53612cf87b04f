"""Build the course site: a static HTML book of the committed notebooks, without running them.

    .venv/bin/python tools/build_site.py            # build/site-src -> site/ (what `make site` runs first)

Steps: read and check every notebook in notebooks/ (a damaged one stops the build with one
line naming the file, the cell and the fix), assemble the Sphinx sources in build/site-src/
(docs/site's pages, a copy of every notebook and of docs/ARCHITECTURE.md and
docs/WORKSHOP.md), then run ``sphinx-build -W --keep-going`` into site/. Nothing is
executed and nothing in the repository is written except site/ and build/ (both
git-ignored). Every NN_*.ipynb in notebooks/ is a lesson: a new one appears without a list
to update. While copying:

- each lesson gets, under its title, what it teaches (README.md's course table) and a
  "Run this notebook" box: locally (``make lab``), in a hosted notebook service, as a
  download of the notebook as committed, and its exercises;
- every saved figure gets alt text: the cell's ``accumlab.alt`` metadata (what the figure
  shows, written with the notebook), else its title in the code, else the text above it;
- a prediction's answer is folded by the notebook itself (``exNN.<name>.reveal`` saves a
  closed ``<details>``), and the page shows it as saved: closed, folded once; a cell whose
  outputs the notebook saves collapsed (``jupyter.outputs_hidden``) shows them folded,
  opened on a click;
- under each exercise's checking cell, its hints and its solution, folded (<details>);
  exercises.md lists every exercise by lesson with what it practises;
- the terms a lesson teaches (README.md's course table: code spans, OOM, DDP, ...) become
  main index entries at the first section that uses them, so the search lists that lesson
  first and opens that section;
- reference/api.md documents every public name: ``accumlab.__all__``, each public
  subpackage's ``__all__``, the course helpers and the exercise checkers;
- a relative link to a file that is a page of the site points to that page, a link to any
  other file of the repository points to it on the repository host, and a link to a file
  that does not exist stops the build;
- the landing page's lesson table is made from README.md's course table (what each
  lesson teaches) and docs/WORKSHOP.md's measured run-all time per notebook, and its study
  times (the core path, everything) from the notebooks by tools/course_time.py's formula.

tools/check_site.py then checks the built site (`make site` runs both).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import html
import importlib
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import time
import warnings
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
DOWNLOADS_DIR = "_notebooks"  # the notebooks as committed, offered for download
EXERCISES_PAGE = "exercises.md"
DOC_PAGES = {
    "docs/INSTALL.md": "docs/install.md",
    "docs/CLI.md": "docs/cli.md",
    "docs/RESUME.md": "docs/resume.md",
    "docs/AUDIT.md": "docs/audit.md",
    "docs/ARCHITECTURE.md": "docs/architecture.md",
    "docs/WORKSHOP.md": "docs/workshop.md",
}
_MD_LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def note(message: str) -> None:
    """A line on stderr for what the site shows in a degraded way (never silently)."""
    print(f"build_site: note: {message}", file=sys.stderr)


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


def lesson_notebooks(folder: Path = REPO / "notebooks") -> list[Path]:
    """The course's notebooks, in order (notebooks/NN_*.ipynb): every file there is a
    lesson, so a new one appears on the site without a list to update."""
    found = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise SiteError(f"no NN_*.ipynb notebooks found in {folder}")
    return found


_IMAGE_SIGNATURES = {"image/png": (b"\x89PNG\r\n\x1a\n", b"IEND"), "image/jpeg": (b"\xff\xd8\xff", b"\xff\xd9")}


def _shown(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def read_notebook(path: Path) -> dict:
    """A lesson notebook, checked well enough that the site can show it: JSON with a list
    of cells, each with a type and a source, and every saved PNG or JPEG figure decodable
    and complete. Anything else raises SiteError naming the file, the cell and the fix."""
    where = _shown(path)
    fix = f"restore it (git checkout -- {where}) or re-execute it (make notebooks NOTEBOOKS={where})"
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise SiteError(f"{where} is not UTF-8 text (byte {err.start}): {fix}") from None
    except json.JSONDecodeError as err:
        raise SiteError(
            f"{where} is not valid JSON ({err.msg}: line {err.lineno}, column {err.colno}; "
            f"a cut or hand-edited file?): {fix}"
        ) from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise SiteError(f"{where} is not a notebook: it has no list of 'cells' at its top level: {fix}")
    if nb.get("nbformat") != 4 or not isinstance(nb.get("metadata", {}), dict):
        raise SiteError(f"{where} is not an nbformat 4 notebook (nbformat: {nb.get('nbformat')!r}): {fix}")
    for i, cell in enumerate(nb["cells"], 1):
        if not isinstance(cell, dict) or cell.get("cell_type") not in ("markdown", "code", "raw"):
            raise SiteError(f"{where}, cell {i}: not a cell (no cell_type markdown, code or raw): {fix}")
        source = cell.get("source")
        if isinstance(source, list) and all(isinstance(line, str) for line in source):
            cell["source"] = "".join(source)
        elif not isinstance(source, str):
            raise SiteError(f"{where}, cell {i}: its source is not text: {fix}")
        outputs = cell.get("outputs", [])
        if not isinstance(outputs, list):
            raise SiteError(f"{where}, cell {i}: its outputs are not a list: {fix}")
        for j, out in enumerate(outputs, 1):
            data = out.get("data", {}) if isinstance(out, dict) else None
            if not isinstance(data, dict):
                raise SiteError(f"{where}, cell {i}, output {j}: not an output: {fix}")
            for mime, (head, tail) in _IMAGE_SIGNATURES.items():
                if mime not in data:
                    continue
                value = data[mime]
                text = "".join(value) if isinstance(value, list) else value
                try:
                    raw = base64.b64decode("".join(str(text).split()), validate=True)
                except (binascii.Error, ValueError):
                    raw = b""
                if not raw.startswith(head) or tail not in raw[-16:]:
                    what = "not base64" if not raw else "cut short or corrupt"
                    raise SiteError(f"{where}, cell {i}, output {j}: its {mime} figure is {what}: {fix}")
    try:  # what myst-nb will read: the notebook format's own schema
        import nbformat
    except ImportError:
        return nb
    try:
        with warnings.catch_warnings():  # a missing cell id is repaired by the reader; not an error
            warnings.simplefilter("ignore")
            nbformat.validate(nbformat.from_dict(nb))
    except nbformat.ValidationError as err:
        first = str(err.message).splitlines()[0]
        raise SiteError(f"{where} does not match the notebook format ({first}): {fix}") from None
    return nb


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


def course_table(stems: list[str], titles: dict[str, str], paths: list[Path]) -> str:
    """The landing page's table of the lessons (MyST Markdown): each lesson with what it
    teaches (README.md), its study time (the core path / everything, from the notebook by
    tools/course_time.py) and its measured run-all time (docs/WORKSHOP.md)."""
    from course_time import measure

    study = {p.stem: measure(p) for p in paths}
    readme = course_rows((REPO / "README.md").read_text(encoding="utf-8"))
    times = run_all_times((REPO / "docs" / "WORKSHOP.md").read_text(encoding="utf-8"))
    # A new lesson is on the site as soon as its notebook is: where README.md or
    # docs/WORKSHOP.md do not describe it yet, its row says so (and the build says it).
    for stem in stems:
        if stem not in readme:
            note(f"README.md's course table has no row for {stem}: its 'teaches' cell is empty")
            readme[stem] = ["(not in README.md's course table yet)"] * len(readme[""])
        if stem[:2] not in times:
            note(f"docs/WORKSHOP.md's run-all table has no time for {stem}")
            times[stem[:2]] = "not measured"
    # a list-table, for its class: on a phone accumlab.css lays each row out as a card
    header = ["lesson", *readme[""], "study: core / all", "run all"]
    lines = [":::{list-table}", ":header-rows: 1", ":class: al-lessons", ""]

    def minutes(stem: str) -> str:
        return f"{study[stem].core.minutes:.0f} / {study[stem].everything.minutes:.0f}\u00a0min"

    for cells in [header] + [
        [f"[{titles[stem]}]({LESSONS_DIR}/{stem}.ipynb)", *readme[stem], minutes(stem), times[stem[:2]]]
        for stem in stems
    ]:
        lines += [f"* - {cells[0]}", *(f"  - {cell}" for cell in cells[1:])]
    lines.append(":::")
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


def run_box(
    stem: str,
    repository: str,
    install_cell: bool = True,
    teaches: str = "",
    exercises: int = 0,
) -> str:
    """What a lesson page shows under its title (MyST Markdown): README.md's line on what it
    teaches (``teaches``), then the "Run this notebook" box: locally, in a hosted service,
    as a download, its ``exercises`` count. ``install_cell``: whether the notebook starts
    with tools/install_cell.py's cell."""
    links = hosted_links(repository, f"{stem}.ipynb")
    hosted = " · ".join(f"[{name}]({url})" for name, url in links.items())
    if install_cell:
        how = "the first code cell installs accumlab there (where it is installed, it does nothing)."
    else:
        how = f'install accumlab there first: `%pip install "accumlab @ git+{repository}@{BRANCH}"`.'

    # (a container, so the search's section links skip this summary: see accumlab.js)
    lines = [":::{container} al-teaches", f"**In this lesson**: {teaches}.", ":::", ""] if teaches else []
    lines += [
        ":::{admonition} Run this notebook",
        ":class: tip run-this-notebook",
        f"- **On your machine**: `make lab` in a clone of the [repository]({repository}) opens "
        f"your own copy, `my-notebooks/{stem}.ipynb` ([how](../index.md#run-it-locally); "
        "Windows: in WSL).",
        f"- **Hosted**, nothing to install: open in {hosted}; {how}",
        f"- **Download**: {{download}}`{stem}.ipynb </{DOWNLOADS_DIR}/{stem}.ipynb>`, with its "
        "saved outputs.",
    ]
    if exercises:
        lines.append(
            f"- **Exercises**: {exercises}, with hints and a solution folded under each "
            f"([all exercises](../{EXERCISES_PAGE}))."
        )
    if stem in TEACHES_LOOP:
        lines.append(
            f"- **The reference loop**: `accumulate` and `train_window`, which this lesson "
            f"teaches, in full: [the reference loop](../{LOOP_PAGE})."
        )
    lines.append(":::")
    return "\n".join(lines)


# --- figures: alt text ---------------------------------------------------------------------

_TITLE_ARG = re.compile(r"""(?:\btitle\s*=|set_title\(|suptitle\(|plt\.title\()\s*f?(["'])(?P<t>.+?)\1""")


def _plain(markdown: str) -> str:
    """Markdown as plain text: math, links, code marks, emphasis and tags removed; an
    underscore inside a word (``window_boundary``) stays."""
    text = re.sub(r"\$+([^$]*)\$+", r"\1", markdown)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>|[`*#]|(?<!\w)_+|_+(?!\w)", "", text)
    return " ".join(text.split())


def _first_sentence(text: str, limit: int = 220) -> str:
    text = re.sub(r"^\d+[a-z]?\.\s+", "", text)  # a section number is not a sentence
    sentence = re.split(r"(?<=[.:!?])\s", text, maxsplit=1)[0].rstrip(":")
    return sentence if len(sentence) <= limit else sentence[: limit - 1].rsplit(" ", 1)[0] + "…"


def figure_alt(source: str, before: str, section: str, given: str = "") -> str:
    """Alt text for a figure a code cell draws: ``given`` (the cell's ``accumlab.alt``
    metadata) when set, else its title in the code (``title=``, ``set_title``,
    ``suptitle``; an f-string's fields by their expressions), else the first sentence of the
    Markdown just above it; with the section it belongs to."""
    found = _TITLE_ARG.search(source)
    if given:
        what = given.rstrip(".")
    elif found:
        what = re.sub(r"\{([^}:!]*)[^}]*\}", lambda m: m.group(1).strip(), found.group("t"))
    else:
        what = _first_sentence(_plain(before)) or "a figure"
    where = f" (section “{_plain(section)}”)" if section else ""
    return f"Figure: {what}{where}"


def add_figure_alts(nb: dict) -> int:
    """Set the alt text of every saved figure (myst-nb's ``mystnb.image.alt`` metadata of its
    cell); returns how many cells have one."""
    section, before, count = "", "", 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            before = cell["source"]
            for line in before.splitlines():
                if re.match(r"#{2,4} ", line):
                    section = line.lstrip("#").strip()
            continue
        images = [o for o in cell.get("outputs", []) if {"image/png", "image/jpeg"} & set(o.get("data", {}))]
        if images:
            metadata = cell.setdefault("metadata", {})
            given = metadata.get("accumlab", {}).get("alt", "")
            alt = figure_alt(cell["source"], before, section, given)
            metadata.setdefault("mystnb", {}).setdefault("image", {})["alt"] = alt
            count += 1
    return count


def fold_collapsed_outputs(nb: dict) -> int:
    """Tag ``hide-output`` (myst-nb folds the output behind a click) on every code cell the
    notebook saves with its outputs collapsed (``metadata.jupyter.outputs_hidden``, what
    JupyterLab shows as a bar to click); returns how many. A prediction's answer is not
    one of them: it is saved folded (``Exercise.reveal``), in a cell saved unfolded
    (tests/notebooks/test_predictions.py), so the page never folds it twice."""
    folded = 0
    for cell in nb["cells"]:
        metadata = cell.get("metadata", {})
        if cell["cell_type"] == "code" and metadata.get("jupyter", {}).get("outputs_hidden"):
            tags = metadata.setdefault("tags", [])
            if "hide-output" not in tags:
                tags.append("hide-output")
            folded += 1
    return folded


# --- exercises -----------------------------------------------------------------------------


def _docstring_bullets(doc: str) -> dict[str, str]:
    """{name: text} of a checker module's ``- ``name``: text`` bullets."""
    found: dict[str, str] = {}
    for match in re.finditer(r"^- ``(\w+)``(?:[^:\n]*):\s*(.+?)(?=^\s*$|^- |\Z)", doc or "", re.M | re.S):
        found[match.group(1)] = " ".join(match.group(2).split()).replace("``", "`")
    return found


def lesson_exercises(stem: str, nb: dict) -> list[dict]:
    """The exercises of a lesson, in the order the notebook checks them: every
    ``exNN.<name>`` the notebook uses, with the section it sits in, what it practises
    (the checker module's docstring, the answer cell's comment, or the section), whether it
    asks for a prediction or for code, and its hints and solution. A name the checker
    module does not define raises SiteError."""
    number = stem[:2]
    try:
        module = importlib.import_module(f"accumlab_course.exercises.ex{number}")
    except ModuleNotFoundError:
        module = None
    from accumlab_course.exercises import Exercise

    defined = {n: v for n, v in vars(module).items() if isinstance(v, Exercise)} if module else {}
    bullets = _docstring_bullets(module.__doc__ if module else "")
    uses = re.compile(rf"\bex{number}\.(\w+)\.(?:check|hint|solution)\(")
    found: dict[str, dict] = {}
    section = ""
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            for line in cell["source"].splitlines():
                if re.match(r"#{2,4} ", line):
                    section = line.lstrip("#").strip()
            continue
        for name in uses.findall(cell["source"]):
            if name in found:
                continue
            if name not in defined:
                raise SiteError(
                    f"notebooks/{stem}.ipynb checks ex{number}.{name}, which "
                    f"course/accumlab_course/exercises/ex{number}.py does not define"
                )
            exercise = defined[name]
            comment = re.search(rf"^\w*{name}\w*\s*=\s*\.\.\.\s*#\s*(.+)$", cell["source"], re.M)
            if name in bullets:
                practises = _first_sentence(bullets[name])
            elif comment:  # "a number: AdamW's update ..." -> "AdamW's update ..."
                practises = re.sub(r"^(?:an? (?:number|int|float|choice|string|bool)\w*)\s*:\s*", "", comment.group(1).strip())
            else:
                practises = re.sub(r"^[\d.]+\s*|^Exercise[^:]*:\s*", "", section)
            predicted = exercise.kind == "prediction"
            found[name] = {
                "name": name,
                "path": f"ex{number}.{name}",
                "cell": i,
                "section": section,
                "practises": practises,
                "kind": "predict first" if predicted else "write code",
                "hints": list(exercise.hints),
                "solution": exercise.reference.strip(),
            }
    return list(found.values())


def exercise_box(exercise: dict) -> str:
    """The folded hints and solution shown under an exercise's checking cell (HTML in
    Markdown: <details> a reader opens on purpose; no script needed)."""
    path = html.escape(exercise["path"])
    hints = "".join(f"<li>{html.escape(h)}</li>" for h in exercise["hints"])
    count = len(exercise["hints"])
    return (
        f'<div class="al-exercise" id="help-{exercise["path"].replace(".", "-")}">\n'
        # no count in the summary: under a prediction, "2 hints" could read as its answer
        f'<details class="al-hints"><summary>{"Hint" if count == 1 else "Hints"} for '
        f"<code>{path}</code> (open when stuck{'' if count == 1 else ', one at a time'})</summary>"
        f"<ol>{hints}</ol></details>\n"
        f'<details class="al-solution"><summary>Solution of <code>{path}</code> (try it first)</summary>'
        f'<pre class="al-solution-text">{html.escape(exercise["solution"])}</pre></details>\n'
        "</div>\n"
    )


def heading_anchor(heading: str) -> str:
    """The id myst-parser gives a Markdown heading (GitHub style)."""
    from myst_parser.slugs import github_slugify

    return github_slugify(re.sub(r"[`*]", "", heading))


def exercises_page(lessons: list[tuple[str, str, list[dict]]]) -> str:
    """The exercise index (Markdown): per lesson, each exercise, what it practises, and a
    link to the section where the notebook checks it."""
    total = sum(len(ex) for _, _, ex in lessons)
    lines = [
        "# Exercises",
        "",
        f"The course's {total} exercises, lesson by lesson, read from the notebooks and their "
        "checkers (`accumlab_course.exercises`). *Predict first* asks for a number or a choice "
        "before the cell that measures it; *write code* asks for a function a checker runs on "
        "fresh inputs and that names the mistake it finds. On each lesson's page, the hints "
        "and the solution are folded under the exercise; in the notebook, "
        "`exNN.name.hint()` and `exNN.name.solution()` print them.",
        "",
    ]
    for stem, title, exercises in lessons:
        lines += [f"## {title}", ""]
        if not exercises:
            lines += ["No exercise in this lesson.", ""]
            continue
        lines += [":::{list-table}", ":header-rows: 1", ":class: al-exercises", ""]
        lines += ["* - exercise", "  - kind", "  - what it practises"]
        for ex in exercises:
            anchor = heading_anchor(ex["section"]) if ex["section"] else ""
            target = f"{LESSONS_DIR}/{stem}.ipynb" + (f"#{anchor}" if anchor else "")
            lines += [f"* - [`{ex['path']}`]({target})", f"  - {ex['kind']}", f"  - {ex['practises']}"]
        lines += [":::", ""]
    return "\n".join(lines)


# --- search: the lesson that teaches a term first ------------------------------------------

# A term README.md's course table names, and the words the lesson itself uses for it.
SYNONYMS = {"OOM": ("out of memory", "out-of-memory", "OutOfMemoryError")}


def teaching_terms(teaches: str) -> list[str]:
    """The terms a lesson teaches, from its README.md course-table cell: the code spans and
    the acronyms and CamelCase names (OOM, DDP, LoRA, GradScaler)."""
    terms = [t.strip() for t in re.findall(r"`([^`]+)`", teaches)]
    plain = re.sub(r"`[^`]+`", " ", teaches)
    terms += re.findall(r"\b(?=\w*[A-Z]\w*[A-Z])[A-Za-z][A-Za-z0-9]+\b", plain)
    keep = [t for t in terms if re.fullmatch(r"[A-Za-z_][\w.]*", t) and len(t) > 1]
    return list(dict.fromkeys(keep))


def _sections(nb: dict) -> list[tuple[int, int, str]]:
    """The lesson's sections: (cell, offset of its '##' heading in that cell, its text up
    to the next heading, code included); what comes before the first '##' is left out."""
    found: list[list] = []
    for i, cell in enumerate(nb["cells"]):
        source = cell["source"]
        starts = [m.start() for m in re.finditer(r"^##+ ", source, re.M)] if cell["cell_type"] == "markdown" else []
        cuts = [0, *starts, len(source)]
        for k, (start, end) in enumerate(zip(cuts, cuts[1:], strict=False)):
            if k:  # a heading starts a section
                found.append([i, start, ""])
            if found:
                found[-1][2] += source[start:end] + "\n"
    return [tuple(f) for f in found]


def add_search_terms(nb: dict, terms: list[str]) -> None:
    """Mark each term as a main index entry at the first section of the lesson that uses it
    (or a synonym): Sphinx's search lists such an entry first and opens that section."""
    places: dict[tuple[int, int], list[str]] = {}
    sections = _sections(nb)
    for term in terms:
        words = [term, *SYNONYMS.get(term, ())]
        for cell, offset, text in sections:
            if any(re.search(rf"(?<![\w.]){re.escape(w)}(?!\w)", text, re.IGNORECASE) for w in words):
                places.setdefault((cell, offset), []).append(term)
                break
    for (cell, offset), found in sorted(places.items(), reverse=True):  # later offsets first
        source = nb["cells"][cell]["source"]
        directives = "".join(f"```{{index}} !{t}\n```\n" for t in found)
        nb["cells"][cell]["source"] = source[:offset] + directives + "\n" + source[offset:]


def _lesson(
    path: Path, pages: dict[str, str], repository: str, teaches: str = ""
) -> tuple[dict, list[dict]]:
    """A lesson's copy for the site, and its exercises: links rewritten, collapsed outputs
    folded, figures with alt text, the run box under the title, hints and solutions folded
    under each exercise, its terms marked for search."""
    nb = read_notebook(path)
    origin, dest = f"notebooks/{path.name}", pages[f"notebooks/{path.name}"]
    if path.stem in TEACHES_LOOP:
        text = "".join(c["source"] for c in nb["cells"])
        if "train_window" not in text and "accumulate" not in text:
            raise SiteError(f"{origin} is listed in TEACHES_LOOP but never names train_window")
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            cell["source"] = rewrite_links(cell["source"], origin, dest, pages, repository)
    fold_collapsed_outputs(nb)
    add_figure_alts(nb)
    exercises = lesson_exercises(path.stem, nb)
    for ex in sorted(exercises, key=lambda e: e["cell"], reverse=True):
        box = {"cell_type": "markdown", "id": f"help-{ex['name']}", "metadata": {}, "source": exercise_box(ex)}
        nb["cells"].insert(ex["cell"] + 1, box)
    add_search_terms(nb, teaching_terms(teaches))
    # The box goes right under the title: the first Markdown cell is split after its
    # '# ' line (the title alone, the box, then the rest of that cell).
    first = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown")
    lines = nb["cells"][first]["source"].splitlines(keepends=True)
    title = next((n for n, line in enumerate(lines) if line.startswith("# ")), 0)
    head, rest = "".join(lines[: title + 1]), "".join(lines[title + 1 :])
    nb["cells"][first]["source"] = head
    has_cell = any(c.get("id") == INSTALL_CELL_ID for c in nb["cells"])
    source = run_box(path.stem, repository, install_cell=has_cell, teaches=teaches, exercises=len(exercises))
    box = {"cell_type": "markdown", "id": "run-this-notebook", "metadata": {}, "source": source}
    new = [box]
    if rest.strip():
        new.append({"cell_type": "markdown", "id": "after-the-title", "metadata": {}, "source": rest})
    nb["cells"][first + 1 : first + 1] = new
    return nb, exercises


def _public_modules() -> list[str]:
    """The subpackages of accumlab with their own ``__all__`` (accumlab.distributed, and
    any added later such as accumlab.hf or accumlab.audit), the course material aside."""
    return sorted(
        p.parent.name
        for p in (REPO / "accumlab").glob("*/__init__.py")
        if p.parent.name != "course" and "__all__" in p.read_text(encoding="utf-8")
    )


def _entry(full: str, obj: object) -> str:
    import inspect

    if inspect.isclass(obj):
        return f".. autoclass:: {full}\n   :members:\n"
    if inspect.isfunction(obj):
        return f".. autofunction:: {full}\n"
    module, _, name = full.rpartition(".")
    return f".. py:data:: {name}\n   :module: {module}\n   :value: {obj!r}\n"


def _alias(full: str, obj: object, original: str) -> str:
    import inspect

    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
    module, _, name = full.rpartition(".")
    return f".. py:{kind}:: {name}\n   :module: {module}\n\n   The same {kind} as :py:obj:`{original}`.\n"


def api_entries() -> str:
    """autodoc directives for every public name: accumlab.__all__, the ``__all__`` of each
    public subpackage (a subpackage that cannot be imported, e.g. for a missing optional
    dependency, is named with the reason), the course helpers and the exercise checkers."""
    import inspect

    sys.path.insert(0, str(REPO))
    import accumlab

    def section(title: str, intro: str, entries: list[str]) -> str:
        body = "\n".join(entries)
        return f"## {title}\n\n{intro}\n\n```{{eval-rst}}\n{body}```\n" if entries else f"## {title}\n\n{intro}\n"

    top = {id(getattr(accumlab, n)): f"accumlab.{n}" for n in accumlab.__all__}
    classes, functions, others = [], [], []
    for name in accumlab.__all__:
        obj = getattr(accumlab, name)
        if inspect.ismodule(obj):
            continue  # its own section below
        (classes if inspect.isclass(obj) else functions if inspect.isfunction(obj) else others).append(
            _entry(f"accumlab.{name}", obj)
        )
    parts = [
        section("Classes", "`import accumlab as al`, then `al.<name>`.", classes),
        section("Functions", "", functions),
        section("Constants", "", others),
    ]
    subpackages = _public_modules()
    for name in accumlab.__all__:  # a module in __all__ without its own __all__: all its members
        obj = getattr(accumlab, name)
        if inspect.ismodule(obj) and name not in subpackages:
            entry = f".. automodule:: accumlab.{name}\n   :members:\n"
            parts.append(section(f"`accumlab.{name}`", "", [entry]))
    for sub in subpackages:
        full = f"accumlab.{sub}"
        try:
            module = importlib.import_module(full)
        except (ImportError, RuntimeError) as err:  # an optional extra that is not installed
            parts.append(section(f"`{full}`", f"Not importable where this site was built ({err}); "
                                 "it needs an optional extra.", []))
            continue
        if not hasattr(module, "__all__"):
            continue  # no public names of its own (internal, or reached through accumlab.__all__)
        entries = [f".. automodule:: {full}\n   :no-members:\n"]
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                entries.append(f".. py:module:: {full}.{name}\n")
            elif id(obj) in top:
                entries.append(_alias(f"{full}.{name}", obj, top[id(obj)]))
            else:
                entries.append(_entry(f"{full}.{name}", obj))
        parts.append(section(f"`{full}`", f"Every name in `{full}.__all__`.", entries))

    helpers = []
    for module_name in course_helper_modules():
        helpers.append(f".. automodule:: {module_name}\n   :members:\n   :undoc-members:\n")
    parts.append(section(
        "Course helpers",
        "`accumlab_course`: what the notebooks use apart from the library (models, data, "
        "widgets, plots, the distributed workers). Not part of the library's contract.",
        helpers,
    ))
    parts.append(exercise_reference())
    return "\n".join(parts)


def course_helper_modules() -> list[str]:
    """accumlab_course's modules (not the exercises, documented on their own)."""
    return [
        f"accumlab_course.{p.stem}"
        for p in sorted((REPO / "course" / "accumlab_course").glob("*.py"))
        if not p.stem.startswith("_")
    ]


def exercise_reference() -> str:
    """The reference section of the checkers: the Exercise class, then every exercise of
    every exNN module, linked to the lesson that uses it."""
    exercises = importlib.import_module("accumlab_course.exercises")
    entries = [
        ".. autoclass:: accumlab_course.exercises.Exercise\n   :members: check, hint, solution, path\n",
    ]
    for path in sorted(Path(exercises.__file__).parent.glob("ex[0-9][0-9].py")):
        module = importlib.import_module(f"accumlab_course.exercises.{path.stem}")
        lesson = next((p.stem for p in lesson_notebooks() if p.name[:2] == path.stem[2:]), None)
        where = f":doc:`lesson {path.stem[2:]} </{LESSONS_DIR}/{lesson}>`" if lesson else "no lesson yet"
        entries.append(f".. py:module:: accumlab_course.exercises.{path.stem}\n")
        bullets = _docstring_bullets(module.__doc__ or "")
        for name, value in vars(module).items():
            if not isinstance(value, exercises.Exercise):
                continue
            text = bullets.get(name, "").replace("`", "``").replace("````", "``")
            entries.append(
                f".. py:data:: {name}\n   :module: accumlab_course.exercises.{path.stem}\n\n"
                f"   Exercise of {where}: ``{path.stem}.{name}.check(answer)``, "
                f"``.hint(n)``, ``.solution()`` ({len(value.hints)} hints).\n"
                + (f"   {text}\n" if text else "")
            )
    return (
        "## Exercise checkers\n\n`accumlab_course.exercises`: one module per lesson; each "
        "exercise is an `Exercise` with `check`, `hint` and `solution` (the "
        f"[exercise index](../{EXERCISES_PAGE}) lists them by lesson).\n\n"
        "```{eval-rst}\n" + "\n".join(entries) + "```\n"
    )


def study_time(notebooks: list[Path]) -> str:
    """The two study times, computed from the notebooks (tools/course_time.py): "3 h 45 min
    for the core path, 9 h 50 min for everything" (README.md and docs/WORKSHOP.md state the
    same, tests/notebooks/test_course_time.py checks)."""
    from course_time import course_time, hours

    _, core, everything = course_time(notebooks)
    return f"{hours(core.minutes)} for the core path, {hours(everything.minutes)} for everything"


def assemble(dest: Path = BUILD_SRC, notebooks: Path = REPO / "notebooks") -> list[str]:
    """Write the Sphinx sources into ``dest`` (emptied first); returns the lesson stems.
    Every notebook is read and checked before anything is written."""
    repository = project_urls()["Repository"]
    paths = lesson_notebooks(notebooks)
    for path in paths:
        read_notebook(path)  # a damaged notebook stops here, named, before any work
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(SITE_SOURCES, dest, ignore=shutil.ignore_patterns("conf.py", "_ext", "__pycache__"))
    stems = [p.stem for p in paths]
    pages = {f"notebooks/{p.name}": f"{LESSONS_DIR}/{p.name}" for p in paths}
    pages.update(DOC_PAGES)
    pages["accumlab/loop.py"] = LOOP_PAGE
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    pages["README.md"] = "index.md"
    teaches = course_rows(readme)

    (dest / LESSONS_DIR).mkdir()
    (dest / DOWNLOADS_DIR).mkdir()
    titles, listed = {}, []
    for path in paths:
        nb, exercises = _lesson(path, pages, repository, teaches.get(path.stem, [""])[0])
        titles[path.stem] = notebook_title(nb)
        listed.append((path.stem, titles[path.stem], exercises))
        (dest / LESSONS_DIR / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False), encoding="utf-8")
        shutil.copy2(path, dest / DOWNLOADS_DIR / path.name)  # the download: the notebook as committed
    for origin, page in DOC_PAGES.items():
        text = (REPO / origin).read_text(encoding="utf-8")
        (dest / page).parent.mkdir(parents=True, exist_ok=True)
        (dest / page).write_text(rewrite_links(text, origin, page, pages, repository), encoding="utf-8")
    (dest / EXERCISES_PAGE).write_text(exercises_page(listed), encoding="utf-8")

    index = (dest / "index.md").read_text(encoding="utf-8")
    fill = {
        "{{COURSE_TABLE}}": course_table(stems, titles, paths),
        "{{LESSON_ENTRIES}}": "\n".join(f"{LESSONS_DIR}/{s}" for s in stems),
        "{{QUICK_START}}": quick_start(readme),
        "{{FIRST_LESSON}}": f"{LESSONS_DIR}/{stems[0]}.ipynb",
        "{{FIRST_NUMBER}}": stems[0][:2],
        "{{LESSON_COUNT}}": str(len(stems)),
        "{{LESSON_COUNT_WORD}}": _count_word(len(stems)),
        "{{STUDY_TIME}}": study_time(paths),
        "{{EXERCISE_COUNT}}": str(sum(len(ex) for _, _, ex in listed)),
    }
    for key, value in fill.items():
        index = index.replace(key, value)
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


def _count_word(n: int) -> str:
    words = "zero one two three four five six seven eight nine ten eleven twelve".split()
    return words[n] if n < len(words) else str(n)


def build(out: Path = OUT, work: Path | None = None, quiet: bool = True, notebooks: Path = REPO / "notebooks") -> float:
    """Assemble the sources and run Sphinx (warnings are errors); returns seconds taken.
    ``work`` holds the sources and Sphinx's cache (default: build/site-src, build/site-doctrees)."""
    start = time.perf_counter()
    src, doctrees = (BUILD_SRC, DOCTREES) if work is None else (work / "src", work / "doctrees")
    # Sphinx writes into html/ inside the work folder, then the result is copied to `out`:
    # myst-nb puts its image folder (jupyter_execute/) beside Sphinx's output folder, which
    # must not be the repository root.
    html = doctrees.parent / "site-html" / "html"
    assemble(src, notebooks)
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
    parser.add_argument("--notebooks", type=Path, default=REPO / "notebooks", help="the lessons (default: notebooks/)")
    args = parser.parse_args(argv)
    try:
        seconds = build(args.out, args.work, quiet=not args.verbose, notebooks=args.notebooks)
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
