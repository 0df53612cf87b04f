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
- the search index holds ``no_sync``.

It reads files only: no browser, no network (tools/browse_site.py is the browser check).
"""

from __future__ import annotations

import ast
import base64
import binascii
import html
import posixpath
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from build_site import LESSONS_DIR, OUT, TEACHES_LOOP  # noqa: E402


class _Page(HTMLParser):
    """The ids, links (href), sources (src) and images of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.sources: list[str] = []
        self.images: list[str] = []

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
