"""A learner's session in a real browser leaves the repository clean.

Starts ``make lab`` in a clean clone of this repository (the environment of this checkout
is reused: VENV=...), opens JupyterLab in headless Chromium, and for every lesson in
``my-notebooks/``: runs all cells, answers the first prediction stub (``name = ...``) and
runs its checker, saves. Then it checks what a learner would otherwise find out at the
next ``git pull``:

- ``git status --porcelain`` in the clone is empty (nothing tracked changed);
- every copy in ``my-notebooks/`` was saved with new outputs and the answer;
- JupyterLab started quietly (no news pop-up, no "Skipped non-installed server(s)" line).

Screenshots go to ``--shots`` (default /tmp/learner-run). Not part of ``make test``: it
needs Chromium and Playwright (``apt-get install chromium``, ``pip install playwright``)
and takes several minutes.

    .venv/bin/python tools/check_learner_run.py            # every lesson
    .venv/bin/python tools/check_learner_run.py 00 07      # some
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "learner-run-check"
STAMPS = (".installed-torch", ".installed-core", ".installed-lab")  # the Makefile's install steps
STUB = re.compile(r"^(\w+) = \.\.\.", re.MULTILINE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float = 120) -> None:
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"JupyterLab did not answer at {url}")


PROMPTS = ("() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))"
           ".map(p => p.textContent.trim())")


def wait_until_run(page, timeout: float = 900) -> None:
    """Until every code cell shows an execution count; raises if the run stops short."""
    start, quiet_since = time.monotonic(), None
    while time.monotonic() - start < timeout:
        prompts = page.evaluate(PROMPTS)
        if prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return
        if any("*" in p for p in prompts):
            quiet_since = None
        else:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 30:
                unrun = sum(not re.fullmatch(r"\[\d+\]:", p) for p in prompts)
                raise RuntimeError(f"the run stopped with {unrun} cell(s) not executed (an error?)")
        time.sleep(2)
    raise TimeoutError("the notebook did not finish running")


def run_lesson(page, name: str, shots: Path) -> str:
    """Open my-notebooks/<name>, run all, answer the first stub, save; return the answer's cell."""
    # One page for the whole session, as a learner's browser tab: close every tab, then
    # open the lesson from the file system, as a double click in the file browser does.
    page.evaluate("() => window.jupyterapp.commands.execute('application:close-all')")
    time.sleep(1)
    page.evaluate(f"() => window.jupyterapp.commands.execute('docmanager:open', "
                  f"{{path: 'my-notebooks/{name}'}})")
    page.wait_for_selector(".jp-Notebook .jp-Cell >> visible=true", timeout=120_000)
    page.wait_for_function("() => document.querySelector('.jp-Notebook-ExecutionIndicator') "
                           "|| document.body.innerText.includes('Idle')", timeout=120_000)
    time.sleep(2)  # the kernel starts
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
    wait_until_run(page)
    # Answer the first stub through the notebook's own model (the editor a learner types
    # into; windowed rendering keeps off-screen cells out of reach of clicks), then run
    # that cell and the next one (its checker) with JupyterLab's commands.
    answered = page.evaluate("""() => {
        const panel = window.jupyterapp.shell.currentWidget;
        const notebook = panel.content;
        const cells = notebook.widgets;
        for (let i = 0; i < cells.length; i++) {
            const shared = cells[i].model.sharedModel;
            const m = shared.getSource().match(/^(\\w+) = \\.\\.\\./m);
            if (cells[i].model.type === 'code' && m) {
                shared.setSource(shared.getSource().replace(m[1] + ' = ...', m[1] + ' = 0'));
                notebook.activeCellIndex = i;
                return m[1];
            }
        }
        return '';
    }""")
    if answered:
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-cell-and-select-next')")
        time.sleep(2)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-cell-and-select-next')")
        time.sleep(3)
        wait_until_run(page)
    page.keyboard.press("Control+s")
    time.sleep(3)
    page.screenshot(path=str(shots / f"{Path(name).stem}.png"), full_page=False)
    return answered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", help="lesson numbers (default: all)")
    parser.add_argument("--shots", default="/tmp/learner-run", type=Path)
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    args.shots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "accumlab"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        port = free_port()
        log = open(Path(tmp) / "lab.log", "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        lab = subprocess.Popen(
            # The clone borrows this checkout's environment (VENV=...); -o keeps make from
            # re-running its install steps, which would install accumlab (editable) from the
            # clone into this checkout's .venv.
            ["make", *(f"-o{ROOT / '.venv' / stamp}" for stamp in STAMPS),
             "lab", f"VENV={ROOT / '.venv'}", f"LAB_PORT={port}",
             f"LAB_ARGS=--no-browser --ServerApp.token={TOKEN} --ServerApp.port_retries=0 "
             "--LabApp.expose_app_in_browser=True"],
            cwd=clone, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        problems = []
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(f"{base}/api/status?token={TOKEN}")
            lessons = sorted(p.name for p in (clone / "my-notebooks").glob("[0-9][0-9]_*.ipynb"))
            if args.lessons:
                lessons = [n for n in lessons if any(n.startswith(x) for x in args.lessons)]
            before = {n: (clone / "my-notebooks" / n).read_bytes() for n in lessons}
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium")
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"{base}/lab/workspaces/accumlab?token={TOKEN}")
                page.wait_for_selector(".jp-Notebook", timeout=120_000)
                time.sleep(5)
                page.screenshot(path=str(args.shots / "opened.png"))
                if "Jupyter news" in page.inner_text("body"):
                    problems.append("the Jupyter news pop-up showed")
                opened = page.locator(".lm-TabBar-tabLabel").all_inner_texts()
                if not any("00_start_here" in t for t in opened):
                    problems.append(f"the workspace opened {opened}, not 00_start_here")
                for name in lessons:
                    start = time.monotonic()
                    answered = run_lesson(page, name, args.shots)
                    saved = (clone / "my-notebooks" / name).read_bytes()
                    nb = json.loads(saved)
                    sources = "\n".join("".join(c["source"]) for c in nb["cells"])
                    print(f"{name}: ran, answered {answered or '(no stub)'}, saved in "
                          f"{time.monotonic() - start:.0f} s", flush=True)
                    if saved == before[name]:
                        problems.append(f"{name}: the copy was not saved")
                    if answered and f"{answered} = 0" not in sources:
                        problems.append(f"{name}: the answer to {answered} is not in the saved copy")
                browser.close()
        finally:
            os.killpg(lab.pid, signal.SIGINT)
            time.sleep(1)
            os.killpg(lab.pid, signal.SIGTERM)
            lab.wait(timeout=60)
            log.close()
        status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True,
                                text=True, check=True).stdout
        server_log = (Path(tmp) / "lab.log").read_text()
        if status.strip():
            problems.append(f"git status is not clean:\n{status}")
        if "Skipped non-installed server" in server_log:
            problems.append("JupyterLab printed 'Skipped non-installed server(s)'")
        print("git status --porcelain:", repr(status))
    for p in problems:
        print("PROBLEM:", p)
    print("learner run check:", "passed" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
