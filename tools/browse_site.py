"""Open the built course site in a real browser (headless Chromium) and check what a reader sees.

    .venv/bin/python tools/browse_site.py [--site site] [--shots /tmp/site-shots]

Serves site/ (build it first: `make site`) on 127.0.0.1 and, at desktop (1280 px) and
phone (390 px) widths, opens the landing page and every lesson page:

- no console error, no uncaught page error, no failed request (the site must work offline);
- every image has loaded (``naturalWidth > 0``);
- the sidebar lists every lesson (desktop; on the phone after opening the menu);
- the search page finds ``no_sync``, with notebook 04 among the results.

Screenshots (the top of each page, the landing page in full, a saved figure and a saved
widget) go to ``--shots``. Needs ``pip install playwright`` and a system Chromium
(``apt-get install chromium``); it never downloads a browser. Not part of `make test`.
Exit code 1 when a check fails, with one line per failure.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
WIDTHS = {"desktop": (1280, 800), "phone": (390, 844)}

IMAGES_JS = """() => [...document.images].map(i => ({src: i.currentSrc || i.src,
  ok: i.complete && i.naturalWidth > 0}))"""
OVERFLOW_JS = "() => document.documentElement.scrollWidth - window.innerWidth"


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


def browse(site: Path, shots: Path, executable: str = CHROMIUM) -> list[str]:
    """Every failure found; screenshots are written to ``shots``."""
    from playwright.sync_api import sync_playwright

    failures: list[str] = []
    shots.mkdir(parents=True, exist_ok=True)
    lessons = _lessons(site)
    expected = len(list((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")))
    if len(lessons) != expected:
        failures.append(
            f"expected {expected} lesson pages in {site}/lessons (one per notebook), "
            f"found {len(lessons)}"
        )
    pages = ["index", *(f"lessons/{s}" for s in lessons), "reference/loop"]
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
                for name in pages:
                    failures += _check_page(context, base, name, kind, shots)
                failures += _check_sidebar(context, base, kind, lessons, shots)
                failures += _check_search(context, base, kind, shots)
                context.close()
            browser.close()
    finally:
        server.shutdown()
    return failures


def _check_page(context, base: str, name: str, kind: str, shots: Path) -> list[str]:
    failures: list[str] = []
    page = context.new_page()
    where = f"{kind} {name}"
    page.on("console", lambda m: m.type == "error" and failures.append(f"{where}: console error: {m.text}"))
    page.on("pageerror", lambda e: failures.append(f"{where}: page error: {e}"))
    page.on("requestfailed", lambda r: failures.append(f"{where}: request failed: {r.url}"))
    page.on("response", lambda r: r.status >= 400 and failures.append(f"{where}: HTTP {r.status}: {r.url}"))
    page.goto(f"{base}/{name}.html", wait_until="load")
    page.wait_for_load_state("networkidle")
    images = page.evaluate(IMAGES_JS)
    failures += [f"{where}: image did not load: {i['src']}" for i in images if not i["ok"]]
    overflow = page.evaluate(OVERFLOW_JS)
    if overflow > 1:
        failures.append(f"{where}: the page is {overflow} px wider than the screen")
    slug = name.replace("/", "-")
    page.screenshot(path=shots / f"{kind}-{slug}.png")
    if name == "index":
        page.screenshot(path=shots / f"{kind}-{slug}-full.png", full_page=True)
    views = {  # what a reader scrolls to, on the pages that have it
        "figure": (".cell_output img", ("00_start_here", "02_token_weighting")),
        "widget": (".static-widget", ("00_start_here", "02_token_weighting")),
        "code": (".cell_output, div.highlight", ("01_single_device_loop", "reference/loop")),
    }
    for label, (selector, where_shown) in views.items():
        element = page.query_selector(selector)
        if element and name.endswith(where_shown):
            element.scroll_into_view_if_needed()
            page.screenshot(path=shots / f"{kind}-{slug}-{label}.png")
    print(f"{where}: {len(images)} images loaded", flush=True)
    page.close()
    return failures


def _check_sidebar(context, base: str, kind: str, lessons: list[str], shots: Path) -> list[str]:
    """Every lesson is on screen in the sidebar: at once on a desktop, after a tap on
    the menu button on a phone."""
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
    return [f"{kind}: the sidebar does not show {missing} on screen"] if missing else []


def _check_search(context, base: str, kind: str, shots: Path) -> list[str]:
    page = context.new_page()
    page.goto(f"{base}/search.html?q=no_sync", wait_until="load")
    try:
        page.wait_for_selector("#search-results ul.search li", timeout=15000)
    except Exception:  # playwright's TimeoutError
        page.close()
        return [f"{kind}: the search for no_sync found nothing"]
    hrefs = page.eval_on_selector_all("#search-results ul.search li a", "els => els.map(e => e.getAttribute('href'))")
    page.screenshot(path=shots / f"{kind}-search-no_sync.png")
    page.close()
    print(f"{kind}: search for no_sync: {len(hrefs)} results", flush=True)
    if not any("04_ddp_no_sync" in (h or "") for h in hrefs):
        return [f"{kind}: the search for no_sync does not list notebook 04 ({hrefs[:5]})"]
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
