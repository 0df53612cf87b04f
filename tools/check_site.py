"""Check the built course site (site/, from tools/build_site.py); `make site` runs it last.

    .venv/bin/python tools/check_site.py [SITE_DIR]

Fails (exit 1, one line per problem) unless:

- every notebook notebooks/NN_*.ipynb has its page lessons/NN_*.html, and the landing page
  links to each of them;
- each lesson page links to the lesson before and after it (previous / next);
- every image a page shows exists and is not empty (a data: image decodes to bytes);
- every local link (href or src, no scheme) points to a file that exists, and a
  ``#fragment`` to a page points to an id on that page;
- the reference loop page shows ``accumulate`` and ``train_window`` in full, and the lessons
  that teach them link to it;
- the search index holds ``no_sync``, and ``OOM`` as a main entry of lesson 05 (the
  lesson whose README.md row teaches it);
- no raw TeX (``$$``, ``\\frac``, ``\\text{``) in a page's prose: math sits in MathJax's
  elements, and a page with math loads the site's own MathJax;
- each lesson page offers its notebook for download, the file there is that notebook as
  committed, and no link points into ``_sources/`` (which the site does not copy);
- no page can be wider than a phone (390 px): every page loads accumlab.css, whose rule
  wraps code and output lines (a static proxy for tools/browse_site.py's measurement), and
  no page sets ``white-space: pre``/``nowrap`` inline or a width over 390 px;
- every image has alt text that says what it shows (not empty, not a file name or hash);
- every public name has an entry in reference/api.html: ``accumlab.__all__``, each public
  subpackage's ``__all__``, the course helpers' functions and classes, every exercise;
- every exercise a notebook checks is listed in exercises.html with a link to its lesson,
  and its lesson page folds its hints and solution;
- no test machinery on a lesson page (``NBVAL_`` markers, a Makefile check) and no
  issue number on any page;
- a prediction's answer is folded on its page: every answer a notebook saves
  (``exNN.<name>.reveal``: a ``<details class="accumlab-answer">``) is there, closed, and
  not inside another fold (no double folding); a cell the notebook saves with its outputs
  collapsed is folded too;
- the landing page has a "Start lesson 00 →" link and the study times computed from the
  notebooks (tools/course_time.py).

It reads files only: no browser, no network (tools/browse_site.py is the browser check).
"""

from __future__ import annotations

import ast
import base64
import binascii
import hashlib
import html
import importlib
import inspect
import json
import posixpath
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from build_site import LESSONS_DIR, OUT, TEACHES_LOOP, study_time  # noqa: E402

NOTEBOOKS = REPO / "notebooks"
PHONE_PX = 390
_RAW_TEX = re.compile(r"\$\$|\\frac\b|\\text\{|\\times\b")
_HASHED_ALT = re.compile(r"[0-9a-f]{16,}|\.(?:png|jpe?g|svg)$", re.IGNORECASE)


# accumlab.css gives these overflow-x: auto (a saved widget's own HTML table)
_SCROLL_BOXES = {"static-widget"}
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Page(HTMLParser):
    """The ids, links (href), sources (src), images with their alt text, inline styles and
    widths of one HTML page, and its prose: the article's text outside math, code, scripts
    and styles."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.sources: list[str] = []
        self.images: list[str] = []
        self.alts: dict[str, str] = {}
        self.styles: list[str] = []
        self.widths: list[tuple[str, str]] = []
        self.prose: list[str] = []
        self.text: list[str] = []
        self.scripts: list[str] = []
        self._stack: list[bool] = []  # per open element: is it (inside) math/code/script?
        self._article = 0
        self._boxed: list[bool] = []  # per open element: inside a box that scrolls itself?

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and "name" in a:
            self.ids.add(a["name"])
        if "href" in a and tag in ("a", "link"):
            self.links.append(a["href"])
        if "src" in a:
            self.sources.append(a["src"])
            if tag == "img":
                self.images.append(a["src"])
                self.alts[a["src"]] = a.get("alt", "")
            if tag == "script":
                self.scripts.append(a["src"])
        classes = a.get("class", "").split()
        boxed = bool(self._boxed and self._boxed[-1]) or any(c in _SCROLL_BOXES for c in classes)
        if "style" in a and not boxed:  # inside a box that scrolls on its own, it cannot widen the page
            self.styles.append(a["style"])
        for key in ("width", "min-width"):
            if key in a and tag in ("img", "table", "iframe", "div", "pre", "video", "canvas"):
                self.widths.append((tag, a[key]))
        if tag in _VOID:
            return
        self._boxed.append(boxed)
        hidden = (self._stack[-1] if self._stack else False) or tag in ("script", "style", "pre", "code", "kbd") or any(
            c.startswith("math") for c in classes
        )
        self._stack.append(hidden)
        if tag == "article":
            self._article += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        if self._stack:
            self._stack.pop()
        if self._boxed:
            self._boxed.pop()
        if tag == "article":
            self._article -= 1

    def handle_data(self, data: str) -> None:
        if self._article > 0:
            self.text.append(data)
            if not (self._stack and self._stack[-1]):
                self.prose.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _is_local(url: str) -> bool:
    parts = urlsplit(url)
    return not parts.scheme and not parts.netloc and bool(parts.path or parts.fragment)


def _words(text: str) -> str:
    return " ".join(html.unescape(text).split())


def loop_functions() -> dict[str, str]:
    """The source of ``accumulate`` and ``train_window`` in accumlab/loop.py."""
    source = (REPO / "accumlab" / "loop.py").read_text(encoding="utf-8")
    found = {
        node.name: ast.get_source_segment(source, node)
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name in ("accumulate", "train_window")
    }
    return {name: found.get(name) or "def " + name for name in ("accumulate", "train_window")}


def public_names() -> dict[str, list[str]]:
    """Every name the API reference must document, by where it comes from (read from the
    package, not from the page builder): ``accumlab.__all__``, each subpackage's
    ``__all__`` (one that cannot be imported for a missing optional dependency is left
    out), the functions and classes defined in each course helper module, and every
    exercise of every ``accumlab_course.exercises.exNN``."""
    import accumlab

    names: dict[str, list[str]] = {"accumlab": [], "course helpers": [], "exercises": []}
    for name in accumlab.__all__:
        if inspect.ismodule(getattr(accumlab, name)):
            names["accumlab"].append(f"module-accumlab.{name}")
        else:
            names["accumlab"].append(f"accumlab.{name}")
    for init in sorted((REPO / "accumlab").glob("*/__init__.py")):
        sub = init.parent.name
        if sub == "course" or "__all__" not in init.read_text(encoding="utf-8"):
            continue
        try:
            module = importlib.import_module(f"accumlab.{sub}")
        except (ImportError, RuntimeError):  # an optional extra that is not installed
            continue
        if hasattr(module, "__all__"):  # a subpackage that declares its public names
            names[f"accumlab.{sub}"] = [f"accumlab.{sub}.{n}" for n in module.__all__]
    for path in sorted((REPO / "course" / "accumlab_course").glob("*.py")):
        if path.stem.startswith("_"):
            continue
        module = importlib.import_module(f"accumlab_course.{path.stem}")
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value) or inspect.isclass(value):
                names["course helpers"].append(f"{module.__name__}.{name}")
    exercises = importlib.import_module("accumlab_course.exercises")
    for path in sorted((REPO / "course" / "accumlab_course" / "exercises").glob("ex[0-9][0-9].py")):
        module = importlib.import_module(f"accumlab_course.exercises.{path.stem}")
        for name, value in vars(module).items():
            if isinstance(value, exercises.Exercise):
                names["exercises"].append(f"{module.__name__}.{name}")
    return names


def notebook_exercises(path: Path) -> list[str]:
    """``exNN.name`` of every exercise a notebook checks, in order (read from its code)."""
    number = path.name[:2]
    found: list[str] = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell.get("cell_type") == "code":
            for name in re.findall(rf"\bex{number}\.(\w+)\.(?:check|hint|solution)\(", "".join(cell["source"])):
                if f"ex{number}.{name}" not in found:
                    found.append(f"ex{number}.{name}")
    return found


def _css_wraps_code(site: Path) -> bool:
    css = site / "_static" / "accumlab.css"
    if not css.is_file():
        return False
    for rule in re.findall(r"([^{}]+)\{([^{}]*)\}", css.read_text(encoding="utf-8")):
        selectors, body = rule
        if "white-space: pre-wrap" in body and all(s in selectors for s in ("div.cell_input pre", "div.cell_output pre", "div.highlight pre")):
            return True
    return False


def _extended_checks(site: Path, pages: dict[str, _Page], stems: list[str]) -> list[str]:
    problems: list[str] = []
    content = {n: p for n, p in pages.items() if not n.startswith(("_static/", "genindex", "search", "py-modindex"))}
    wraps = _css_wraps_code(site)
    if not wraps:
        problems.append("_static/accumlab.css has no rule wrapping code and output lines (pre-wrap): pages scroll sideways")
    for name, page in content.items():
        prose = " ".join(page.prose)
        raw = _RAW_TEX.search(prose)
        if raw:
            problems.append(f"{name}: raw TeX {raw.group(0)!r} in the text (not typeset as math)")
        if not any(urlsplit(u).path.endswith("_static/accumlab.css") for u in page.links):
            problems.append(f"{name}: does not load accumlab.css (code would not wrap on a phone)")
        for style in page.styles:
            if re.search(r"white-space\s*:\s*(?:pre|nowrap)\b(?!-)", style):
                problems.append(f"{name}: an inline style {style!r} keeps a line from wrapping")
        for tag, width in page.widths:
            number = re.match(r"\s*(\d+)", width)
            if number and not width.strip().endswith("%") and int(number.group(1)) > PHONE_PX:
                problems.append(f"{name}: a <{tag}> {width} wide, wider than a {PHONE_PX} px phone")
        for src, alt in page.alts.items():
            if len(alt.strip()) < 20 or _HASHED_ALT.search(alt.strip()):
                problems.append(f"{name}: an image without meaningful alt text ({alt!r}): {src[:60]}")
        text = " ".join(page.text)
        if re.search(r"\bissue \d+\b", text):
            problems.append(f"{name}: a project issue number in the text")
        if name.startswith(f"{LESSONS_DIR}/") and re.search(r"NBVAL_|Makefile really has|makefile\.read_text", text):
            problems.append(f"{name}: test machinery (nbval markers or 00's Makefile check) on the page")
        if any(u.startswith("_sources/") or "/_sources/" in u for u in page.links):
            problems.append(f"{name}: a link into _sources/, which the site does not copy")
    for name in content:
        body = (site / name).read_text(encoding="utf-8")
        if "class=\"math" in body and not any("mathjax/MathJax.js" in s for s in pages[name].scripts):
            problems.append(f"{name}: has math but does not load the site's own MathJax")

    for stem in stems:
        lesson = f"{LESSONS_DIR}/{stem}.html"
        if lesson not in pages:
            continue
        downloads = [u for u in pages[lesson].links if urlsplit(u).path.endswith(f"/{stem}.ipynb") and "_downloads/" in u]
        if not downloads:
            problems.append(f"{lesson}: no download link for {stem}.ipynb")
        for url in downloads:
            target = site / posixpath.normpath(posixpath.join(LESSONS_DIR, unquote(urlsplit(url).path)))
            original = NOTEBOOKS / f"{stem}.ipynb"
            if not target.is_file() or hashlib.sha256(target.read_bytes()).digest() != hashlib.sha256(original.read_bytes()).digest():
                problems.append(f"{lesson}: the download {url} is not notebooks/{stem}.ipynb as committed")

    api = pages.get("reference/api.html")
    for where, names in public_names().items():
        for full in names:
            if api is None or full not in api.ids:
                problems.append(f"reference/api.html has no entry for {full.removeprefix('module-')} ({where})")

    listing = pages.get("exercises.html")
    listed_text = " ".join(listing.text) if listing else ""
    for stem in stems:
        path = NOTEBOOKS / f"{stem}.ipynb"
        lesson = f"{LESSONS_DIR}/{stem}.html"
        if listing is None or not any(urlsplit(u).path == lesson for u in listing.links):
            problems.append(f"exercises.html does not list lesson {stem}")
        page = (site / lesson).read_text(encoding="utf-8") if lesson in pages else ""
        folded = page.count("hide below-input")
        if folded < collapsed_reveals(path):
            problems.append(f"{lesson}: {collapsed_reveals(path)} collapsed outputs in the notebook, "
                            f"{folded} folded on the page (a prediction's answer in view)")
        answers = answer_folds(page)
        if answers["answers"] < saved_answers(path):
            problems.append(f"{lesson}: {saved_answers(path)} folded answers in the notebook, "
                            f"{answers['answers']} on the page")
        if answers["open"]:
            problems.append(f"{lesson}: {answers['open']} answer(s) shown open (a prediction's "
                            "answer in view)")
        if answers["nested"]:
            problems.append(f"{lesson}: {answers['nested']} answer(s) folded twice (inside "
                            "another fold): save the revealing cell unfolded")
        for exercise in notebook_exercises(path):
            if exercise not in listed_text:
                problems.append(f"exercises.html does not list {exercise} of lesson {stem}")
            if lesson in pages and f"help-{exercise.replace('.', '-')}" not in pages[lesson].ids:
                problems.append(f"{lesson}: no folded hints and solution for {exercise}")

    index = pages.get("index.html")
    if index is not None:
        start = f"{LESSONS_DIR}/{stems[0]}.html" if stems else ""
        body = (site / "index.html").read_text(encoding="utf-8")
        if not re.search(r'<a class="[^"]*al-start[^"]*" href="' + re.escape(start) + '"', body) and not re.search(
            r'href="' + re.escape(start) + r'"[^>]*class="[^"]*al-start', body
        ):
            problems.append(f"index.html has no 'Start lesson {stems[0][:2] if stems else ''} →' link to {start}")
        said = " ".join(" ".join(index.text).split())
        times = study_time([NOTEBOOKS / f"{stem}.ipynb" for stem in stems])
        if times not in said:
            problems.append(f"index.html does not give the study time ({times})")
    return problems


ANSWER_CLASS = "accumlab-answer"  # what Exercise.reveal folds a prediction's answer in


def saved_answers(path: Path) -> int:
    """How many folded answers a notebook saves (outputs of ``exNN.<name>.reveal``)."""
    return sum(
        1
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]
        for out in cell.get("outputs", [])
        if ANSWER_CLASS in "".join(out.get("data", {}).get("text/html", ""))
    )


class _Folds(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[bool] = []  # one entry per open <details>: is it an answer?
        self.found = {"answers": 0, "open": 0, "nested": 0}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag != "details":
            return
        values = dict(attrs)
        answer = ANSWER_CLASS in (values.get("class") or "").split()
        if answer:
            self.found["answers"] += 1
            self.found["open"] += "open" in values
            self.found["nested"] += bool(self.stack)
        self.stack.append(answer)

    def handle_endtag(self, tag: str) -> None:
        if tag == "details" and self.stack:
            self.stack.pop()


def answer_folds(page: str) -> dict[str, int]:
    """On one page: the folded answers, how many are open, how many sit inside another
    ``<details>`` (folded twice)."""
    parser = _Folds()
    parser.feed(page)
    return parser.found


def collapsed_reveals(path: Path) -> int:
    """How many code cells a notebook saves with their outputs collapsed (the reveal after a
    prediction: ``metadata.jupyter.outputs_hidden``)."""
    return sum(
        1
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]
        if cell.get("cell_type") == "code" and cell.get("outputs")
        and cell.get("metadata", {}).get("jupyter", {}).get("outputs_hidden")
    )


def _search_index(site: Path) -> dict:
    text = (site / "searchindex.js").read_text(encoding="utf-8")
    start, end = text.find("("), text.rfind(")")
    try:
        return json.loads(text[start + 1 : end])
    except ValueError:
        return {}


def check_site(site: Path) -> list[str]:
    """Every problem found in the built site at ``site`` (empty when it is correct)."""
    problems: list[str] = []
    if not (site / "index.html").is_file():
        return [f"{site}/index.html is missing: build the site first (make site)"]
    pages = {p.relative_to(site).as_posix(): _parse(p) for p in sorted(site.rglob("*.html"))}

    stems = [p.stem for p in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    lessons = [f"{LESSONS_DIR}/{s}.html" for s in stems]
    index_links = {urlsplit(u).path for u in pages["index.html"].links}
    for i, lesson in enumerate(lessons):
        if lesson not in pages:
            problems.append(f"notebooks/{stems[i]}.ipynb has no page {lesson}")
            continue
        if lesson not in index_links:
            problems.append(f"index.html does not link to {lesson}")
        links = {posixpath.basename(urlsplit(u).path) for u in pages[lesson].links}
        for j in (i - 1, i + 1):
            if 0 <= j < len(stems) and f"{stems[j]}.html" not in links:
                problems.append(f"{lesson} does not link to its neighbour {stems[j]}.html")
        if stems[i] in TEACHES_LOOP and "loop.html" not in links:
            problems.append(f"{lesson} teaches the reference loop but does not link to it")

    for name, page in pages.items():
        if name.startswith("_static/"):
            continue  # the theme's template fragments, not pages
        for url in page.images:
            if url.startswith("data:"):
                try:
                    if not base64.b64decode(url.split(",", 1)[1], validate=False):
                        problems.append(f"{name}: an empty data: image")
                except (IndexError, binascii.Error):
                    problems.append(f"{name}: an undecodable data: image")
        for url in dict.fromkeys(page.links + page.sources):
            if not _is_local(url):
                continue
            parts = urlsplit(url)
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), unquote(parts.path))) if parts.path else name
            path = site / target
            if target.startswith("../") or not path.exists() or (path.is_file() and path.stat().st_size == 0):
                what = "image" if url in page.images else "target"
                problems.append(f"{name}: missing or empty {what} {url}")
                continue
            if parts.fragment and target.endswith(".html") and target in pages:
                if unquote(parts.fragment) not in pages[target].ids:
                    problems.append(f"{name}: {url} points to no id on {target}")

    loop = site / "reference" / "loop.html"
    shown = _words(re.sub(r"<[^>]+>", "", loop.read_text(encoding="utf-8"))) if loop.is_file() else ""
    for function, source in loop_functions().items():
        if _words(source) not in shown:
            problems.append(f"reference/loop.html does not show {function} in full, as in accumlab/loop.py")
    index = site / "searchindex.js"
    if not index.is_file() or "no_sync" not in index.read_text(encoding="utf-8"):
        problems.append("searchindex.js does not hold no_sync")
    else:
        search = _search_index(site)
        docnames = search.get("docnames", [])
        oom = [e for e in search.get("indexentries", {}).get("oom", []) if e[2]]
        teaching = [s for s in stems if s.startswith("05_")]
        if teaching and not any(docnames[e[0]] == f"{LESSONS_DIR}/{teaching[0]}" for e in oom):
            problems.append(f"searchindex.js: OOM is not a main entry of {teaching[0]} (search would not list it first)")
    problems += _extended_checks(site, pages, stems)
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    site = Path(argv[0]) if argv else OUT
    problems = check_site(site)
    for problem in problems:
        print(f"check_site: {problem}", file=sys.stderr)
    if problems:
        print(f"check_site: {len(problems)} problem(s) in {site}", file=sys.stderr)
        return 1
    count = len(list(site.rglob("*.html")))
    print(f"check_site: {site} is complete: {count} pages, every lesson, image and local link present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
