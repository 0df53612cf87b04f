"""The course site: tools/build_site.py's pieces, the static widget drawing, and
tools/check_site.py catching what a broken site looks like.

The full build (`make site`: Sphinx over every notebook, warnings as errors, then the
check) runs once here, in a temporary folder, when Sphinx and myst-nb are installed (the
``site`` extra); the unit tests below need neither.
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "docs" / "site" / "_ext"))

import build_site  # noqa: E402
import check_site  # noqa: E402

LESSONS = sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
HAVE_SPHINX = all(importlib.util.find_spec(m) for m in ("sphinx", "myst_nb", "sphinx_book_theme"))


# --- assembling the sources ---------------------------------------------------------------


def test_project_urls_name_an_https_repository():
    urls = build_site.project_urls()
    assert urls["Repository"].startswith("https://") and not urls["Repository"].endswith("/")


def test_hosted_links_open_the_notebook_of_the_repository():
    links = build_site.hosted_links("https://github.com/acme/course", "01_x.ipynb")
    assert links["Colab"] == "https://colab.research.google.com/github/acme/course/blob/main/notebooks/01_x.ipynb"
    assert links["Binder"] == "https://mybinder.org/v2/gh/acme/course/main?labpath=notebooks%2F01_x.ipynb"
    with pytest.raises(build_site.SiteError, match="github.com"):
        build_site.hosted_links("https://gitlab.com/acme/course", "01_x.ipynb")


def test_links_go_to_pages_or_to_the_repository_and_missing_files_stop_the_build():
    pages = {"accumlab/loop.py": "reference/loop.md", "docs/WORKSHOP.md": "docs/workshop.md"}
    repo = "https://github.com/acme/course"
    text = (
        "[loop](../accumlab/loop.py) [kit](../docs/WORKSHOP.md#the-plan-3-hours) "
        "[plan](../accumlab/plan.py) ![x](https://e.org/a.png) [here](#top)"
    )
    out = build_site.rewrite_links(text, "notebooks/01.ipynb", "lessons/01.ipynb", pages, repo)
    assert "[loop](../reference/loop.md)" in out
    assert "[kit](../docs/workshop.md#the-plan-3-hours)" in out
    assert f"[plan]({repo}/blob/main/accumlab/plan.py)" in out
    assert "![x](https://e.org/a.png)" in out and "[here](#top)" in out
    with pytest.raises(build_site.SiteError, match="missing file 'accumlab/nope.py'"):
        build_site.rewrite_links("[a](../accumlab/nope.py)", "notebooks/01.ipynb", "x.md", pages, repo)


def test_the_landing_table_lists_every_lesson_with_what_it_teaches_and_its_time():
    titles = {s: f"Title {s}" for s in LESSONS}
    paths = [REPO / "notebooks" / f"{stem}.ipynb" for stem in LESSONS]
    table = build_site.course_table(LESSONS, titles, paths)
    assert table.startswith(":::{list-table}") and table.endswith("\n:::")
    rows = [row.splitlines() for row in table.removesuffix("\n:::").split("\n* - ")[1:]]
    assert len(rows) == 1 + len(LESSONS) and rows[0][0] == "lesson"
    readme = build_site.course_rows((REPO / "README.md").read_text(encoding="utf-8"))
    for stem, row in zip(LESSONS, rows[1:], strict=True):
        assert row[0] == f"[Title {stem}](lessons/{stem}.ipynb)"
        assert row[1] == f"  - {readme[stem][0]}"  # what it teaches, from README.md
        assert re.fullmatch(r"  - [\d.]+\u00a0s", row[-1])  # its run-all time, from docs/WORKSHOP.md
        assert re.fullmatch(r"  - \d+ / \d+\u00a0min", row[-2])  # its study time: core / all


def test_a_readme_without_the_course_table_is_an_error():
    with pytest.raises(build_site.SiteError, match="The course"):
        build_site.course_rows("# accumlab\n\nno table here\n")


def test_the_run_box_links_to_local_and_hosted_runs_and_to_the_loop_where_taught():
    box = build_site.run_box("01_single_device_loop", "https://github.com/acme/course")
    assert "make lab" in box and "colab.research.google.com/github/acme/course" in box
    assert "mybinder.org/v2/gh/acme/course" in box and "reference/loop.md" in box
    assert "reference/loop.md" not in build_site.run_box("02_token_weighting", "https://github.com/a/b")
    assert "first code cell installs" in box
    without = build_site.run_box("02_token_weighting", "https://github.com/a/b", install_cell=False)
    assert '%pip install "accumlab @ git+https://github.com/a/b@main"' in without
    assert "first code cell" not in without


def test_assembled_sources_have_every_lesson_once_with_its_box(tmp_path):
    stems = build_site.assemble(tmp_path / "src")
    assert stems == LESSONS
    for stem in LESSONS:
        nb = json.loads((tmp_path / "src" / "lessons" / f"{stem}.ipynb").read_text(encoding="utf-8"))
        boxes = [c for c in nb["cells"] if c.get("id") == "run-this-notebook"]
        assert len(boxes) == 1 and nb["cells"][1] is boxes[0]  # right under the title
        assert nb["cells"][0]["source"].startswith("# ") and nb["cells"][0]["source"].count("\n") <= 1
        original = json.loads((REPO / "notebooks" / f"{stem}.ipynb").read_text(encoding="utf-8"))
        added = {"run-this-notebook"} | {c["id"] for c in nb["cells"] if c.get("id", "").startswith("help-")}
        words = lambda text: re.findall(r"\w+", re.sub(r"\]\([^)]*\)", "]", text))  # noqa: E731  (link targets are rewritten)
        shown = Counter(w for c in nb["cells"] if c.get("id") not in added for w in words(c["source"]))
        was = Counter(w for c in original["cells"] for w in words("".join(c["source"])))
        assert was - shown == Counter(), stem  # nothing of the notebook's text lost
    index = (tmp_path / "src" / "index.md").read_text(encoding="utf-8")
    assert "{{" not in index and "docs/workshop.md" in index
    api = (tmp_path / "src" / "reference" / "api.md").read_text(encoding="utf-8")
    for group, names in check_site.public_names().items():
        for full in names:
            module, _, name = full.removeprefix("module-").rpartition(".")
            if group == "course helpers":
                assert f".. automodule:: {module}\n" in api, full
            else:
                assert f" {full.removeprefix('module-')}\n" in api or f":: {name}\n   :module: {module}\n" in api, full


# --- the static drawing of saved widgets --------------------------------------------------


def test_saved_widgets_are_drawn_from_their_state():
    import accumlab_site

    state = {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_s", "IPY_MODEL_h"]}},
        "s": {
            "model_name": "IntSliderModel",
            "state": {"description": "A <x>", "value": 8, "min": 1, "max": 64, "step": 1, "readout_format": "d"},
        },
        "h": {"model_name": "HTMLModel", "state": {"value": "<b>64</b>"}},
    }
    drawn = accumlab_site.widget_html({"model_id": "box"}, state)
    assert 'type="range" min="1" max="64" step="1" value="8" disabled' in drawn
    assert "A &lt;x&gt;" in drawn and "<b>64</b>" in drawn and "<script" not in drawn
    with pytest.raises(accumlab_site.WidgetStateError, match="not in the notebook's saved state"):
        accumlab_site.widget_html({"model_id": "gone"}, state)


def test_every_saved_widget_of_the_course_can_be_drawn():
    import accumlab_site

    views = 0
    for stem in LESSONS:
        path = REPO / "notebooks" / f"{stem}.ipynb"
        state = accumlab_site.notebook_widget_state(path)
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            for out in cell.get("outputs", []):
                view = out.get("data", {}).get(accumlab_site.VIEW_MIME)
                if view:
                    views += 1
                    assert 'class="static-widget"' in accumlab_site.widget_html(view, state)
                elif 'class="static-widget"' in "".join(out.get("data", {}).get("text/html", "")):
                    views += 1  # saved as its drawing already (tools/run_notebooks.py)
    assert views >= 2  # notebooks 00 and 02 ship a widget each


# --- the check catches a broken site ------------------------------------------------------

CSS = (REPO / "docs" / "site" / "_static" / "accumlab.css").read_text(encoding="utf-8")
STUDY = build_site.study_time(sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")))


def _page(path: Path, body: str, depth: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    css = "../" * depth + "_static/accumlab.css"
    path.write_text(
        f'<html><head><link rel="stylesheet" href="{css}"></head><body><article class="bd-article">'
        f"{body}</article></body></html>",
        encoding="utf-8",
    )


def _good_site(site: Path) -> None:
    """A minimal site that passes: every lesson, linked in order, with its download and its
    exercises' hints; the exercise index; an API page with every public name; the loop page;
    search; the stylesheet that wraps code."""
    (site / "_static").mkdir(parents=True)
    (site / "_static" / "accumlab.css").write_text(CSS, encoding="utf-8")
    lessons = "".join(f'<a href="lessons/{s}.html">{s}</a>' for s in LESSONS)
    start = f'<a class="reference internal al-start" href="lessons/{LESSONS[0]}.html">Start lesson 00 →</a>'
    _page(
        site / "index.html",
        f'<a id="top" href="#top">top</a>{start}<p>{STUDY}</p>{lessons}'
        '<img src="_images/a.png" alt="Figure: peak memory against the microbatch size">',
    )
    (site / "_images").mkdir()
    (site / "_images" / "a.png").write_bytes(b"\x89PNG")
    listing = []
    for i, stem in enumerate(LESSONS):
        near = [LESSONS[j] for j in (i - 1, i + 1) if 0 <= j < len(LESSONS)]
        links = "".join(f'<a href="{s}.html">n</a>' for s in near) + '<a href="../reference/loop.html">loop</a>'
        download = f"_downloads/{i:02d}/{stem}.ipynb"
        (site / download).parent.mkdir(parents=True)
        shutil.copy(REPO / "notebooks" / f"{stem}.ipynb", site / download)
        exercises = check_site.notebook_exercises(REPO / "notebooks" / f"{stem}.ipynb")
        helps = "".join(f'<div id="help-{e.replace(".", "-")}">hints</div>' for e in exercises)
        folds = '<details class="admonition hide below-input">x</details>' * check_site.collapsed_reveals(
            REPO / "notebooks" / f"{stem}.ipynb")
        folds += '<details class="accumlab-answer"><summary>s</summary>x</details>' * check_site.saved_answers(
            REPO / "notebooks" / f"{stem}.ipynb")
        body = links + f'<a href="../{download}">download</a>' + helps + folds + '<a href="../index.html#top">home</a>'
        body += '<div class="math notranslate">\\[\\frac{a}{b}\\]</div><script src="../_static/mathjax/MathJax.js"></script>'
        _page(site / "lessons" / f"{stem}.html", body, depth=1)
        listing.append(f'<a href="lessons/{stem}.html">{stem}</a>' + " ".join(exercises))
    (site / "_static" / "mathjax").mkdir()
    (site / "_static" / "mathjax" / "MathJax.js").write_text("/* MathJax */")
    _page(site / "exercises.html", "".join(listing))
    names = [n for group in check_site.public_names().values() for n in group]
    _page(site / "reference" / "api.html", "".join(f'<dt id="{n}">{n}</dt>' for n in names), depth=1)
    shown = "".join(f"<pre>{html.escape(source)}</pre>" for source in check_site.loop_functions().values())
    _page(site / "reference" / "loop.html", shown, depth=1)
    docnames = [f"lessons/{s}" for s in LESSONS]
    five = next(i for i, s in enumerate(LESSONS) if s.startswith("05_"))
    index = {"docnames": docnames, "terms": {"no_sync": [1]}, "indexentries": {"oom": [[five, "index-0", True]]}}
    (site / "searchindex.js").write_text(f"Search.setIndex({json.dumps(index)})")


def test_a_complete_site_passes(tmp_path):
    _good_site(tmp_path)
    assert check_site.check_site(tmp_path) == []


def test_an_output_saved_collapsed_must_be_folded_on_its_page(tmp_path, monkeypatch):
    """No lesson saves a cell collapsed today (a prediction's answer is folded by the
    notebook itself), so a lesson that would is simulated: one collapsed output in lesson
    00's notebook and no fold on its page is named."""
    _good_site(tmp_path)
    first = REPO / "notebooks" / f"{LESSONS[0]}.ipynb"
    monkeypatch.setattr(check_site, "collapsed_reveals", lambda path: 1 if path == first else 0)
    problems = check_site.check_site(tmp_path)
    assert len(problems) == 1 and "1 collapsed outputs in the notebook, 0 folded on the page" in problems[0]


def _lesson_page(site: Path, n: int) -> Path:
    return site / "lessons" / f"{LESSONS[n]}.html"


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, (old, text[:300])
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def _first_answer() -> int:
    for n, stem in enumerate(LESSONS):
        if check_site.saved_answers(REPO / "notebooks" / f"{stem}.ipynb"):
            return n
    raise AssertionError("no notebook saves a folded answer")


def _first_exercise() -> tuple[int, str]:
    for n, stem in enumerate(LESSONS):
        found = check_site.notebook_exercises(REPO / "notebooks" / f"{stem}.ipynb")
        if found:
            return n, found[0]
    raise AssertionError("no notebook checks an exercise")


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda s: _lesson_page(s, 3).unlink(), f"has no page lessons/{LESSONS[3]}.html"),
        (lambda s: (s / "_images" / "a.png").unlink(), "missing or empty image _images/a.png"),
        (lambda s: (s / "_images" / "a.png").write_bytes(b""), "missing or empty image"),
        (lambda s: _page(s / "extra.html", '<a href="nowhere.html">x</a>'), "missing or empty target nowhere.html"),
        (lambda s: _page(s / "extra.html", '<a href="index.html#gone">x</a>'), "points to no id on index.html"),
        (lambda s: _page(_lesson_page(s, 1), "no links", 1), "does not link to its neighbour"),
        (lambda s: _page(s / "reference" / "loop.html", "def accumulate(", 1), "does not show accumulate in full"),
        (lambda s: (s / "searchindex.js").write_text("{}"), "does not hold no_sync"),
        # raw TeX, downloads, width, alt text, the reference, the exercises, search
        (lambda s: _page(s / "extra.html", "<p>$$ L = \\frac{a}{b} $$</p>"), "raw TeX '$$'"),
        (lambda s: _page(s / "extra.html", "<p>the mean \\frac{1}{N} of it</p>"), "raw TeX '\\\\frac'"),
        (lambda s: (s / "_static" / "mathjax" / "MathJax.js").unlink(), "missing or empty target ../_static/mathjax/MathJax.js"),
        (lambda s: _edit(_lesson_page(s, 2), '<script src="../_static/mathjax/MathJax.js"></script>', ""), "has math but does not load"),
        (lambda s: next((s / "_downloads").glob("*/*.ipynb")).write_text('{"cells": []}'), "is not notebooks/"),
        (lambda s: _edit(_lesson_page(s, 4), f"{LESSONS[4]}.ipynb", "other.ipynb"), f"no download link for {LESSONS[4]}.ipynb"),
        (lambda s: _page(s / "extra.html", '<a href="_sources/x.ipynb.txt">.ipynb</a>'), "a link into _sources/"),
        (lambda s: (s / "_static" / "accumlab.css").write_text("pre { overflow-x: auto; }"), "no rule wrapping code"),
        (lambda s: _page(s / "extra.html", '<pre style="white-space: pre">x</pre>'), "keeps a line from wrapping"),
        (lambda s: _page(s / "extra.html", '<img src="_images/a.png" width="640">'), "wider than a 390 px phone"),
        (lambda s: s.joinpath("extra.html").write_text("<html><body><p>no stylesheet</p></body></html>"), "does not load accumlab.css"),
        (lambda s: _page(s / "extra.html", '<img src="_images/a.png" alt="../_images/3f2a9c4be7d1a0c5e6f7.png">'), "without meaningful alt text"),
        (lambda s: _page(s / "extra.html", '<img src="_images/a.png">'), "without meaningful alt text"),
        (lambda s: _edit(s / "reference" / "api.html", '<dt id="accumlab.train_window">', "<dt>"), "no entry for accumlab.train_window"),
        (lambda s: _edit(s / "reference" / "api.html", '<dt id="accumlab.distributed.shard">', "<dt>"), "no entry for accumlab.distributed.shard"),
        (lambda s: _edit(s / "reference" / "api.html", '<dt id="accumlab_course.exercises.ex01.adamw_ratio">', "<dt>"), "no entry for accumlab_course.exercises.ex01.adamw_ratio"),
        (lambda s: _edit(s / "exercises.html", f'<a href="lessons/{LESSONS[2]}.html">', "<a>"), f"does not list lesson {LESSONS[2]}"),
        (lambda s: _edit(s / "exercises.html", _first_exercise()[1], "?"), f"does not list {_first_exercise()[1]}"),
        (lambda s: _edit(_lesson_page(s, _first_exercise()[0]), f'id="help-{_first_exercise()[1].replace(".", "-")}"', ""), "no folded hints and solution"),
        (lambda s: _edit(_lesson_page(s, 0), "home</a>", "home</a><pre># NBVAL_IGNORE_OUTPUT</pre>"), "test machinery"),
        (lambda s: _page(s / "docs" / "workshop.html", "<p>the estimate of the review, issue 11</p>", 1), "issue number"),
        (lambda s: _edit(_lesson_page(s, _first_answer()), '<details class="accumlab-answer">', "<p>"), "folded answers in the notebook"),
        (lambda s: _edit(_lesson_page(s, _first_answer()), '<details class="accumlab-answer">', '<details open class="accumlab-answer">'), "shown open"),
        (lambda s: _edit(_lesson_page(s, _first_answer()), '<details class="accumlab-answer"><summary>s</summary>x</details>',
                         '<details class="hide"><details class="accumlab-answer"><summary>s</summary>x</details></details>'), "folded twice"),
        (lambda s: _edit(s / "index.html", "al-start", "other"), "no 'Start lesson 00 →' link"),
        (lambda s: _edit(s / "index.html", STUDY, "soon"), "study time"),
        (lambda s: _edit(s / "searchindex.js", '"oom"', '"oomx"'), "OOM is not a main entry"),
    ],
)
def test_the_check_names_what_is_broken(tmp_path, breakage, message):
    _good_site(tmp_path)
    breakage(tmp_path)
    problems = check_site.check_site(tmp_path)
    assert any(message in p for p in problems), problems


# --- the real build -----------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_SPHINX, reason="needs the site extra: pip install -e '.[site]'")
@pytest.mark.slow
def test_make_site_builds_every_lesson_offline_and_the_check_passes(tmp_path):
    out = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_site.py"), "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    assert "WARNING" not in build.stderr
    check = subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_site.py"), str(out)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    for stem in LESSONS:
        page = (out / "lessons" / f"{stem}.html").read_text(encoding="utf-8")
        assert "Run this notebook" in page and "colab.research.google.com" in page
        # nothing from a CDN: every script and stylesheet is local
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?:[^"]+)"', page)
        assert [u for u in remote if not u.startswith("https://github.com")] == [], remote
        assert "application/vnd.jupyter.widget-view+json" not in page
    widget = (out / "lessons" / "00_start_here.html").read_text(encoding="utf-8")
    assert 'class="static-widget"' in widget and 'type="range"' in widget
    shutil.rmtree(out)
