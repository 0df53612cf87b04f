"""Open the built course site in a real browser (headless Chromium) and check what a reader sees.

    .venv/bin/python tools/browse_site.py [--site site] [--shots /tmp/site-shots]

Serves site/ (build it first: `make site`) on 127.0.0.1 and, at desktop (1280×800) and
phone (390×844) sizes, opens the landing page, every lesson, the exercise index and the
reference pages. On every page:

- no console error, no uncaught page error, no failed request (the site works offline);
- every image has loaded, has alt text that says what it shows (not a file name), and a
  saved figure is a link to the image itself (tap to open it full size);
- the page is no wider than the screen, no box cuts its content off at the right, and at
  1280 px no code or output box scrolls sideways (long lines wrap);
- no test machinery in the text (``NBVAL_``, the Makefile check of 00, issue numbers).

And per issue 27's items:

1. math is typeset by the local MathJax (02 and 00): no raw ``$$`` or ``\\frac`` left;
2. every lesson's download link answers with its notebook (JSON with cells);
4. ``al.train_window`` in a lesson's text links to its API entry, which exists;
5. search: ``OOM`` lists lesson 05 first and opens a section of it; ``no_sync`` lists 04
   first; no snippet starts with the theme's text (Light, Dark, Search, ...);
7. on the phone, tapping a figure opens it full size;
9. the landing page shows "Start lesson 00 →" in the first screen, the study time,
   Windows and the hosted option, and one search box at 1280 px;
10. the exercise index lists every lesson; hints and solutions are folded until opened;
    the copy button copies a code cell (read back from the clipboard).

Screenshots (the top of each page, the landing page in full, a figure, a widget, math,
code, an opened exercise, the search results) go to ``--shots``. Needs ``pip install
playwright`` and a system Chromium (``apt-get install chromium``); it never downloads a
browser. Not part of `make test`. Exit code 1 when a check fails, one line per failure.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
WIDTHS = {"desktop": (1280, 800), "phone": (390, 844)}

IMAGES_JS = """() => [...document.querySelectorAll('article img, .bd-article img')].map(i => ({
  src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0, alt: i.alt || '',
  link: i.closest('a') ? i.closest('a').getAttribute('href') : null,
  data: (i.getAttribute('src') || '').startsWith('data:')}))"""
# Against the screen's width, not window.innerWidth: a phone browser widens its layout
# viewport to fit a page that overflows (innerWidth grows with the page, so the difference
# would always be 0).
OVERFLOW_JS = "(screen) => Math.max(document.documentElement.scrollWidth, window.innerWidth) - screen"
SCROLLING_CODE_JS = """() => [...document.querySelectorAll('.bd-article pre')]
  .filter(p => p.offsetParent !== null && p.scrollWidth > p.clientWidth + 1)
  .map(p => p.textContent.slice(0, 60))"""
# Content past the right edge of the screen that the reader cannot scroll to: a page
# container clips it (so the page itself does not scroll and OVERFLOW_JS sees nothing).
CUT_JS = """() => { const out = [];
  for (const e of document.querySelectorAll('.bd-article *')) {
    const r = e.getBoundingClientRect();
    if (!r.width || r.right <= document.documentElement.clientWidth + 1 || e.closest('.MathJax_Display, .MathJax')) continue;
    let scrolls = false;
    for (let a = e.parentElement; a && !a.matches('.bd-article'); a = a.parentElement) {
      if (['auto', 'scroll'].includes(getComputedStyle(a).overflowX)) { scrolls = true; break; }
    }
    if (!scrolls && !e.querySelector('*')) out.push(e.tagName.toLowerCase() + ': ' + e.textContent.trim().slice(0, 50));
  }
  return out; }"""
TEXT_JS = "() => document.querySelector('.bd-article') ? document.querySelector('.bd-article').innerText : ''"
THEME_WORDS = ("Light", "Dark", "System Settings", "Search Ctrl", "Skip to main content", "Back to top")
_HASHED = re.compile(r"[0-9a-f]{16,}|\.png$|^\.\./_images/")


def _serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _lessons(site: Path) -> list[str]:
    return sorted(p.stem for p in (site / "lessons").glob("[0-9][0-9]_*.html"))


def _expected_lessons() -> list[str]:
    return sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def browse(site: Path, shots: Path, executable: str = CHROMIUM) -> list[str]:
    """Every failure found; screenshots are written to ``shots``."""
    from playwright.sync_api import sync_playwright

    failures: list[str] = []
    shots.mkdir(parents=True, exist_ok=True)
    lessons = _lessons(site)
    if lessons != _expected_lessons():
        failures.append(f"lesson pages {lessons} are not the notebooks {_expected_lessons()}")
    pages = ["index", *(f"lessons/{s}" for s in lessons), "exercises", "reference/loop", "reference/api", "docs/workshop"]
    server, base = _serve(site)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
            for kind, (width, height) in WIDTHS.items():
                context = browser.new_context(
                    viewport={"width": width, "height": height},
                    is_mobile=kind == "phone", has_touch=kind == "phone",
                    device_scale_factor=2 if kind == "phone" else 1,
                )  # fmt: skip
                context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
                for name in pages:
                    failures += _check_page(context, base, name, kind, shots)
                failures += _check_sidebar(context, base, kind, lessons, shots)
                failures += _check_landing(context, base, kind, shots)
                failures += _check_math(context, base, kind, shots)
                failures += _check_downloads(context, base, kind, lessons)
                failures += _check_name_links(context, base, kind)
                failures += _check_exercises(context, base, kind, lessons, shots)
                for query, lesson, section in (("OOM", "05_", True), ("no_sync", "04_", True), ("GradScaler", "03_", False)):
                    failures += _check_search(context, base, kind, shots, query, lesson, section)
                if kind == "phone":
                    failures += _check_figure_opens(context, base, shots)
                context.close()
            browser.close()
    finally:
        server.shutdown()
    return failures


def _open(context, base: str, name: str, failures: list[str], where: str):
    page = context.new_page()
    page.on("console", lambda m: m.type == "error" and failures.append(f"{where}: console error: {m.text}"))
    page.on("pageerror", lambda e: failures.append(f"{where}: page error: {e}"))
    page.on("requestfailed", lambda r: failures.append(f"{where}: request failed: {r.url}"))
    page.on("response", lambda r: r.status >= 400 and failures.append(f"{where}: HTTP {r.status}: {r.url}"))
    page.goto(f"{base}/{name}", wait_until="load")
    page.wait_for_load_state("networkidle")
    return page


def _check_page(context, base: str, name: str, kind: str, shots: Path) -> list[str]:
    failures: list[str] = []
    where = f"{kind} {name}"
    page = _open(context, base, f"{name}.html", failures, where)
    images = page.evaluate(IMAGES_JS)
    for image in images:
        if not image["ok"]:
            failures.append(f"{where}: image did not load: {image['src'][:80]}")
        if len(image["alt"]) < 20 or _HASHED.search(image["alt"]):
            failures.append(f"{where}: an image without meaningful alt text: {image['alt']!r}")
        if not image["data"] and "_images/" in image["src"] and not (image["link"] or "").endswith(".png"):
            failures.append(f"{where}: a figure that does not open full size: {image['src'][-40:]}")
    overflow = page.evaluate(OVERFLOW_JS, WIDTHS[kind][0])
    if overflow > 1:
        failures.append(f"{where}: the page is {overflow} px wider than the screen")
    cut = page.evaluate(CUT_JS)
    if cut:
        failures.append(f"{where}: {len(cut)} boxes cut their content off at the right, e.g. {cut[0]!r}")
    if kind == "desktop":
        scrolling = page.evaluate(SCROLLING_CODE_JS)
        if scrolling:
            failures.append(f"{where}: {len(scrolling)} code boxes scroll sideways, e.g. {scrolling[0]!r}")
    text = page.evaluate(TEXT_JS)
    for pattern, what in (
        (r"NBVAL_" if name.startswith("lessons/") else r"^$x", "nbval's markers"),
        (r"\bissue \d+\b", "an issue number"),
        (r"Makefile really has|makefile\.read_text", "00's Makefile check"),
    ):
        found = re.search(pattern, text)
        if found:
            failures.append(f"{where}: test machinery in the text ({what}): {found.group(0)!r}")
    slug = name.replace("/", "-")
    page.screenshot(path=shots / f"{kind}-{slug}.png")
    if name == "index":
        page.screenshot(path=shots / f"{kind}-{slug}-full.png", full_page=True)
    views = {  # what a reader scrolls to, on the pages that have it
        "figure": (".cell_output img", ("00_start_here", "04_ddp_no_sync")),
        "widget": (".static-widget", ("00_start_here", "02_token_weighting")),
        "code": ("div.cell_output pre", ("01_single_device_loop", "07_capstone")),
        "table": ("table", ("index", "exercises")),
    }
    for label, (selector, where_shown) in views.items():
        element = page.query_selector(selector)
        if element and name.endswith(where_shown):
            element.scroll_into_view_if_needed()
            page.screenshot(path=shots / f"{kind}-{slug}-{label}.png")
    print(f"{where}: {len(images)} images, overflow {max(overflow, 0)} px", flush=True)
    page.close()
    return failures


def _check_sidebar(context, base: str, kind: str, lessons: list[str], shots: Path) -> list[str]:
    """Every lesson is on screen in the sidebar: at once on a desktop, after a tap on the
    menu button on a phone."""
    page = context.new_page()
    page.goto(f"{base}/index.html", wait_until="load")
    scope = ".bd-sidebar-primary"
    if kind == "phone":  # the sidebar opens as a drawer (a modal dialog) from the menu button
        page.locator("button.primary-toggle:visible").first.click()
        page.wait_for_timeout(600)
        scope = "#pst-primary-sidebar-modal[open]"
        page.screenshot(path=shots / f"{kind}-sidebar-open.png")
    links = page.eval_on_selector_all(
        f"{scope} a.reference.internal",
        """els => els.filter(e => { const r = e.getBoundingClientRect();
                 return r.width > 0 && r.right > 0 && r.left < window.innerWidth; })
               .map(e => e.getAttribute('href'))""",
    )
    listed = [s for s in lessons if any(h and h.endswith(f"lessons/{s}.html") for h in links)]
    page.close()
    missing = sorted(set(lessons) - set(listed))
    return [f"{kind}: the sidebar does not show {missing} on screen"] if missing or not lessons else []


def _check_landing(context, base: str, kind: str, shots: Path) -> list[str]:
    """Item 9: start button in the first screen, study time, Windows, hosted, one search box."""
    failures: list[str] = []
    page = context.new_page()
    page.goto(f"{base}/index.html", wait_until="load")
    start = page.locator("a.al-start")
    if start.count() != 1 or "Start lesson 00" not in start.inner_text():
        failures.append(f"{kind} index: no 'Start lesson 00 →' link")
    else:
        box = start.bounding_box()
        height = WIDTHS[kind][1]
        if not box or box["y"] + box["height"] > height:
            failures.append(f"{kind} index: 'Start lesson 00 →' is below the first screen ({box})")
    text = page.evaluate(TEXT_JS)
    for needle in ("hours", "Windows", "Colab", "WSL"):
        if needle not in text:
            failures.append(f"{kind} index: the landing page does not mention {needle!r}")
    if kind == "desktop":
        boxes = page.evaluate(
            """() => [...document.querySelectorAll('input[type=search], .search-button-field, button.search-button')]
                 .filter(e => { const r = e.getBoundingClientRect();
                   return r.width > 0 && r.height > 0 && getComputedStyle(e).visibility !== 'hidden'; }).length"""
        )
        if boxes != 1:
            failures.append(f"{kind} index: {boxes} search boxes on screen, not one")
    page.close()
    return failures


def _check_math(context, base: str, kind: str, shots: Path) -> list[str]:
    """Item 1: the lessons' formulas typeset by the local MathJax, no raw TeX left."""
    failures: list[str] = []
    for lesson in ("02_token_weighting", "00_start_here"):
        where = f"{kind} {lesson}"
        page = _open(context, base, f"lessons/{lesson}.html", failures, where)
        try:
            page.wait_for_function("() => window.MathJax && MathJax.Hub && MathJax.Hub.queue.pending === 0 "
                                   "&& document.querySelectorAll('.MathJax_Display, .MathJax').length > 0",
                                   timeout=20000)  # fmt: skip
        except Exception:  # playwright's TimeoutError
            failures.append(f"{where}: MathJax typeset nothing")
        text = page.evaluate(TEXT_JS)
        for raw in ("$$", "\\frac", "\\text{", "\\times"):
            if raw in text:
                failures.append(f"{where}: raw TeX {raw!r} in the page's text")
        math = page.query_selector(".MathJax_Display, .math")
        if math:
            math.scroll_into_view_if_needed()
            page.screenshot(path=shots / f"{kind}-{lesson}-math.png")
        page.close()
    return failures


def _check_downloads(context, base: str, kind: str, lessons: list[str]) -> list[str]:
    """Item 2: each lesson offers its notebook, and the link answers with it."""
    failures: list[str] = []
    for lesson in lessons:
        page = context.new_page()
        page.goto(f"{base}/lessons/{lesson}.html", wait_until="domcontentloaded")
        hrefs = page.eval_on_selector_all("a", "els => els.map(e => e.href)")
        page.close()
        if any("/_sources/" in h for h in hrefs):
            failures.append(f"{kind} {lesson}: a link into _sources/ (the theme's broken download menu)")
        mine = [h for h in hrefs if h.endswith(f"/{lesson}.ipynb") and "_downloads" in h]
        if not mine:
            failures.append(f"{kind} {lesson}: no download link for {lesson}.ipynb")
            continue
        response = context.request.get(mine[0])
        try:
            ok = response.status == 200 and isinstance(json.loads(response.body()).get("cells"), list)
        except ValueError:
            ok = False
        if not ok:
            failures.append(f"{kind} {lesson}: the download {mine[0]} is not the notebook (HTTP {response.status})")
    return failures


def _check_name_links(context, base: str, kind: str) -> list[str]:
    """Item 4: a name in a lesson's text links to its API entry, which is there."""
    failures: list[str] = []
    page = context.new_page()
    page.goto(f"{base}/lessons/01_single_device_loop.html", wait_until="load")
    hrefs = page.eval_on_selector_all(
        ".bd-article a:has(code)", "els => els.filter(e => /train_window/.test(e.textContent)).map(e => e.href)"
    )
    page.close()
    if not hrefs:
        return [f"{kind} 01: `train_window` in the text does not link to the reference"]
    page = context.new_page()
    page.goto(hrefs[0], wait_until="load")
    anchor = hrefs[0].partition("#")[2]
    if not anchor or page.query_selector(f"[id='{anchor}']") is None:
        failures.append(f"{kind}: the link {hrefs[0]} lands on no entry")
    page.close()
    return failures


def _check_exercises(context, base: str, kind: str, lessons: list[str], shots: Path) -> list[str]:
    """Item 10: the index lists every lesson's exercises; hints and solutions folded; the
    copy button copies a code cell."""
    failures: list[str] = []
    page = context.new_page()
    page.goto(f"{base}/exercises.html", wait_until="load")
    text = page.evaluate(TEXT_JS)
    hrefs = page.eval_on_selector_all(".bd-article a", "els => els.map(e => e.getAttribute('href'))")
    for lesson in lessons:
        if not any(h and h.startswith(f"lessons/{lesson}.html") for h in hrefs):
            failures.append(f"{kind} exercises: nothing listed for {lesson}")
    if "ex01." not in text:
        failures.append(f"{kind} exercises: no exercise names listed")
    page.close()

    page = context.new_page()
    page.goto(f"{base}/lessons/01_single_device_loop.html", wait_until="load")
    boxes = page.locator("div.al-exercise details")
    if boxes.count() < 2:
        failures.append(f"{kind} 01: no folded hints and solutions ({boxes.count()} boxes)")
    else:
        opened = page.evaluate("() => [...document.querySelectorAll('div.al-exercise details')].filter(d => d.open).length")
        if opened:
            failures.append(f"{kind} 01: {opened} hint or solution boxes open before the reader opens them")
        solution = page.locator("div.al-exercise details.al-solution").first
        solution.locator("summary").click()
        if not solution.locator("pre").is_visible():
            failures.append(f"{kind} 01: a solution does not show when its box is opened")
        solution.scroll_into_view_if_needed()
        page.screenshot(path=shots / f"{kind}-exercise-open.png")
    cell = page.locator("div.cell_input div.highlight").first
    cell.hover()
    button = cell.locator("button.copybtn")
    if button.count() != 1:
        failures.append(f"{kind} 01: no copy button on a code cell")
    else:
        button.click()
        copied = page.evaluate("() => navigator.clipboard.readText()")
        code = cell.locator("pre").inner_text()
        if copied.strip() != code.strip():
            failures.append(f"{kind} 01: the copy button copied {copied[:40]!r}, not the cell's code")
    page.close()
    return failures


def _check_search(context, base: str, kind: str, shots: Path, query: str, lesson: str, section: bool) -> list[str]:
    """Item 5: the lesson that teaches the term first (``section``: landing on a section of
    it, not its top); snippets are the page's own text."""
    page = context.new_page()
    page.goto(f"{base}/search.html?q={query}", wait_until="load")
    try:
        page.wait_for_selector("#search-results ul.search li", timeout=15000)
        page.wait_for_timeout(1500)  # the snippets are fetched after the list
    except Exception:  # playwright's TimeoutError
        page.close()
        return [f"{kind}: the search for {query} found nothing"]
    page.wait_for_function(  # accumlab.js points page-level results at their section
        "() => [...document.querySelectorAll('#search-results ul.search li > a')]"
        ".every(a => a.getAttribute('href').includes('#') || a.dataset.accumlabSection === 'done')",
        timeout=15000,
    )
    hrefs = page.eval_on_selector_all("#search-results ul.search li > a", "els => els.map(e => e.getAttribute('href'))")
    snippets = page.eval_on_selector_all("#search-results ul.search li p.context", "els => els.map(e => e.textContent)")
    page.screenshot(path=shots / f"{kind}-search-{query}.png")
    page.close()
    on_top = sum("#" not in h for h in hrefs)  # where the term is in the page's introduction
    print(f"{kind}: search for {query}: {len(hrefs)} results ({on_top} at a page's top), first {hrefs[:2]}", flush=True)
    failures = []
    if not hrefs or lesson not in hrefs[0] or (section and "#" not in hrefs[0]):
        what = "a section of lesson" if section else "lesson"
        failures.append(f"{kind}: the search for {query} does not open {what} {lesson} first ({hrefs[:3]})")
    for snippet in snippets:
        head = snippet.strip()[:80]
        if any(word in head for word in THEME_WORDS):
            failures.append(f"{kind}: a search snippet for {query} starts with the theme's text: {head!r}")
            break
    return failures


def _check_figure_opens(context, base: str, shots: Path) -> list[str]:
    """Item 7: on a phone, tapping a time-line figure opens it full size."""
    page = context.new_page()
    page.goto(f"{base}/lessons/04_ddp_no_sync.html", wait_until="load")
    figure = page.locator("a.al-figure:visible").first  # not one inside a closed fold
    if figure.count() == 0:
        page.close()
        return ["phone 04: no figure link"]
    shown = figure.locator("img").bounding_box()["width"]
    figure.scroll_into_view_if_needed()
    figure.click()
    page.wait_for_load_state("load")
    size = page.evaluate("() => document.images.length ? document.images[0].naturalWidth : 0")
    page.screenshot(path=shots / "phone-figure-full-size.png")
    page.close()
    if not page.url.endswith(".png") and size <= shown:
        return [f"phone 04: tapping a figure ({shown:.0f} px on screen) does not open it full size ({size} px)"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=REPO / "site")
    parser.add_argument("--shots", type=Path, default=Path("/tmp/site-shots"))
    parser.add_argument("--chromium", default=CHROMIUM, help=f"the browser to drive (default {CHROMIUM})")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"browse_site: {args.site}/index.html is missing: run make site first", file=sys.stderr)
        return 1
    failures = browse(args.site, args.shots, args.chromium)
    for failure in failures:
        print(f"browse_site: {failure}", file=sys.stderr)
    print(f"browse_site: {'FAILED' if failures else 'passed'}; screenshots in {args.shots}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
