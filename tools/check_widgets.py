"""Open the course in a real browser and measure what a learner's mouse meets.

Starts ``make lab`` (the same command a learner runs) on a free port with a known token,
drives headless Chromium through Playwright, and for notebooks 00 and 02:

- checks that the page JupyterLab prints opens the course's workspace: the file browser
  lists the repository root (README.md, accumlab/, examples/) and notebook 00 is open,
  with no click; and that JupyterLab saved its layout inside the virtual environment,
  leaving the committed tools/lab-workspace.json as it was;
- runs every cell, then measures each slider's track (the draggable part) in CSS pixels
  and the gaps between the column headers of the widget tables;
- saves a screenshot of each widget to ``--out`` (default /tmp/accumlab-widgets).

Needs ``pip install playwright`` and a Chromium on disk (``apt-get install chromium``);
it never downloads a browser. Autosave is switched off for this server, so the
notebooks on disk are left as they are. Not part of ``make test``: run it by hand,

    .venv/bin/python tools/check_widgets.py [--repo DIR] [--venv DIR] [--min-track 200]
                                            [--landing-only]

Exit code 1 when a track is narrower than ``--min-track`` px or a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

NOTEBOOKS = ("notebooks/00_start_here.ipynb", "notebooks/02_token_weighting.ipynb")

# Run in the page: every slider's label, its track width and the width of its container;
# and for every table in a widget output, the smallest gap between two header texts.
MEASURE_JS = """
() => {
  const sliders = [...document.querySelectorAll('.widget-slider')].map(s => {
    const track = s.querySelector('.noUi-target, .slider');
    const label = s.querySelector('.widget-label');
    const above = s.previousElementSibling;  // a Label widget above the slider, if any
    return {
      label: (label && label.textContent) || (above ? above.textContent : ''),
      track: track ? track.getBoundingClientRect().width : 0,
      widget: s.getBoundingClientRect().width,
    };
  });
  const textBox = el => { const r = document.createRange(); r.selectNodeContents(el);
                          return r.getBoundingClientRect(); };
  const tables = [...document.querySelectorAll('.widget-html table')].map(t => {
    const heads = [...t.querySelectorAll('tr:first-child th')];
    let gap = Infinity;
    for (let i = 1; i < heads.length; i++) {
      const a = textBox(heads[i - 1]), b = textBox(heads[i]);
      gap = Math.min(gap, b.left - a.right);
    }
    return {headers: heads.map(h => h.textContent), min_gap: heads.length > 1 ? gap : null};
  });
  return {sliders, tables};
}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"JupyterLab did not answer at {url} within {timeout:.0f} s")


def start_lab(repo: Path, venv: Path | None, port: int, token: str, settings: Path,
              log: Path) -> subprocess.Popen:
    """``make lab`` on ``port`` with ``token``, autosave off; its own process group.

    ``venv`` (make's VENV) None: the repository's own ``.venv``.
    """
    plugin = settings / "@jupyterlab" / "docmanager-extension" / "plugin.jupyterlab-settings"
    plugin.parent.mkdir(parents=True)
    plugin.write_text(json.dumps({"autosave": False}))
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings), "TQDM_DISABLE": "1",
           "OMP_NUM_THREADS": "1"}
    args = f"--no-browser --IdentityProvider.token={token}"
    make_venv = [f"VENV={venv}"] if venv is not None else []
    return subprocess.Popen(
        ["make", "-C", str(repo), "lab", *make_venv, f"LAB_PORT={port}", f"LAB_ARGS={args}"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )


def run_all_cells(page, timeout_s: float) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    page.wait_for_timeout(1000)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = page.locator(".jp-InputPrompt", has_text="[*]").count()
        if busy == 0:
            return
        page.wait_for_timeout(500)
    raise RuntimeError(f"cells still running after {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--out", type=Path, default=Path("/tmp/accumlab-widgets"))
    parser.add_argument("--min-track", type=float, default=200.0, help="px")
    parser.add_argument("--width", type=int, default=1280, help="browser window width, px")
    parser.add_argument("--venv", type=Path, default=None,
                        help="make's VENV (default: the repository's .venv)")
    parser.add_argument("--landing-only", action="store_true",
                        help="check what the lab opens on, then stop (no cells are run)")
    args = parser.parse_args()
    args.venv = args.venv.resolve() if args.venv is not None else None  # make -C moves

    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    port, token = free_port(), secrets.token_hex(16)
    problems: list[str] = []
    committed = args.repo / "tools" / "lab-workspace.json"
    committed_before = committed.read_bytes()
    workspaces = (args.venv or args.repo / ".venv") / "lab-workspaces"
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_lab(args.repo, args.venv, port, token, Path(tmp) / "settings",
                           args.out / "lab.log")
        try:
            wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", 120)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=args.chromium, headless=True,
                                             args=["--no-sandbox", "--headless"])
                page = browser.new_page(viewport={"width": args.width, "height": 900})
                # the address a learner copies: the one JupyterLab prints (token masked)
                printed = next(word for line in (args.out / "lab.log").read_text().splitlines()
                               for word in line.split() if word.startswith("http://127.0.0.1"))
                print(f"JupyterLab printed {printed}")
                page.goto(printed.split("?")[0] + f"?token={token}")
                page.wait_for_selector(".jp-DirListing-item", timeout=60_000)
                page.wait_for_selector(".jp-Notebook .jp-Cell", state="attached",
                                       timeout=60_000)
                page.wait_for_timeout(3000)
                tabs = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tabLabel").all_inner_texts()
                current = page.locator(".lm-DockPanel-tabBar .lm-mod-current "
                                       ".lm-TabBar-tabLabel").all_inner_texts()
                print(f"open tabs: {', '.join(tabs)} (current: {', '.join(current)})")
                listing = page.locator(".jp-DirListing-itemText").all_inner_texts()
                print(f"file browser on arrival: {', '.join(listing)}")
                for expected in ("README.md", "accumlab", "examples", "notebooks"):
                    if expected not in listing:
                        problems.append(f"{expected} is not in the file browser on arrival")
                if current != ["00_start_here.ipynb"]:
                    problems.append(f"the open tab is {current}, not notebook 00")
                page.screenshot(path=str(args.out / "lab.png"))
                print(f"screenshot {args.out / 'lab.png'}")
                for notebook in NOTEBOOKS if not args.landing_only else ():
                    name = Path(notebook).stem
                    page.goto(f"http://127.0.0.1:{port}/lab/tree/{notebook}?token={token}")
                    page.wait_for_selector(".jp-Notebook .jp-Cell", state="attached",
                                           timeout=60_000)
                    page.wait_for_timeout(5000)  # kernel start
                    page.keyboard.press("Escape")
                    run_all_cells(page, timeout_s=600)
                    page.wait_for_selector(".widget-slider", timeout=60_000)
                    page.wait_for_timeout(1000)
                    measured = page.evaluate(MEASURE_JS)
                    for s in measured["sliders"]:
                        print(f"{name}: slider {s['label']!r}: track {s['track']:.0f} px "
                              f"(widget {s['widget']:.0f} px)")
                        if s["track"] < args.min_track:
                            problems.append(f"{name}: the track of {s['label']!r} is "
                                            f"{s['track']:.0f} px, under {args.min_track:.0f}")
                    for t in measured["tables"]:
                        if t["min_gap"] is not None:
                            print(f"{name}: table headers {t['headers']}: smallest gap "
                                  f"between header texts {t['min_gap']:.0f} px")
                            if t["min_gap"] < 8:
                                problems.append(f"{name}: table headers {t['headers']} run "
                                                f"together (gap {t['min_gap']:.0f} px)")
                    outputs = page.locator(".jp-OutputArea-output:has(.widget-slider)")
                    for i in range(outputs.count()):
                        shot = args.out / f"{name}_widget{i}.png"
                        outputs.nth(i).scroll_into_view_if_needed()
                        outputs.nth(i).screenshot(path=str(shot))
                        print(f"{name}: screenshot {shot}")
                browser.close()
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    # `make lab` copies the committed layout in; JupyterLab then writes the page's state
    # over that copy, so a saved workspace holds data the committed file does not
    layout = json.loads(committed_before)["data"]
    saved = [w for w in workspaces.glob("*.jupyterlab-workspace")
             if w.stat().st_mtime >= started and json.loads(w.read_text())["data"] != layout]
    print(f"JupyterLab saved its layout to {', '.join(map(str, saved)) or 'nothing'}")
    if not saved:
        problems.append(f"no workspace was written under {workspaces}")
    if committed.read_bytes() != committed_before:
        problems.append(f"{committed} changed while the lab ran")
    for problem in problems:
        print(f"check_widgets: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
