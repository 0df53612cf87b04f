"""The lock (constraints.txt) and the newest releases beside it.

``python tools/lock.py latest``: installs the course's environment with the newest release
of every package (PyTorch stays at the lock's: a newer one on Linux is the multi-GB CUDA
build) into an environment of its own, ``.venv-latest``; prints which releases differ from
the lock; runs the tests that depend on the optional integrations (transformers, TRL,
PEFT, Lightning) and their lessons under strict nbval there; and prints what fails, one
line each. It reports: its exit status is 0 whatever the tests say (1 only when the
environment cannot be built), and nothing in the repository changes.

``python tools/lock.py write [PIN ...]``: resolves the same environment afresh (the newest
releases, but PyTorch at the lock's and any ``PIN`` such as ``transformers==5.25.0``) and
rewrites constraints.txt from it, keeping its header. Moving the lock is a change like any
other: run ``make test`` (and ``make notebooks`` where an output moved) before committing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
#: What makes up the course's environment: what `make lab`, `make test` and `make site`
#: install together (the library with its extras, the course with JupyterLab).
PROJECTS = ["-e", f"{ROOT}[dev,site,peers,hf,lightning]", "-e", f"{ROOT / 'course'}[lab]"]
#: What ``latest`` runs: the tests of the optional integrations and the lessons that use them.
LATEST_TESTS = ["tests/hf", "tests/lightning", "tests/rl"]
LATEST_NOTEBOOKS = ["notebooks/08_audit_your_job.ipynb", "notebooks/09_who_divides_by_what.ipynb"]
#: Left out there: the tests of the older transformers releases (each in a folder of its own
#: that `make slow` installs; they test those releases, not the newest).
LATEST_LEFT_OUT = ["--ignore=tests/hf/test_hf_audit_versions.py",
                   "--deselect=tests/hf/test_hf_callback.py::test_the_callback_under_transformers_4_57"]


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """``{normalized name: release}`` of every ``name==release`` line of the lock."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, release = line.partition("==")
        if not sep:
            raise ValueError(f"{path}: {line!r} is not an exact pin (name==release)")
        pins[normalize(name)] = release.strip()
    return pins


def normalize(name: str) -> str:
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def header(path: Path = LOCK) -> list[str]:
    """The lock's leading comment lines."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        out.append(line)
    return out


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, **kw)


def build(venv: Path, pins: list[str]) -> Path:
    """A virtual environment at ``venv`` with the course's environment at the newest
    releases but ``pins`` (PyTorch's always); returns its Python."""
    python = venv / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", str(venv)], check=True)
    torch = f"torch=={read_lock()['torch']}"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join([torch, *pins]) + "\n")
        constraints = f.name
    try:
        run([*pip, torch], check=True)
        run([*pip, "--upgrade", "--upgrade-strategy", "eager", "-c", constraints, *PROJECTS],
            check=True)
    finally:
        os.unlink(constraints)
    return python


def freeze(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--all", "--exclude-editable"],
                         capture_output=True, text=True, check=True).stdout
    pins = {}
    for line in out.splitlines():
        name, sep, release = line.partition("==")
        if sep and normalize(name) != "pip":
            pins[normalize(name)] = release.split("+", 1)[0]  # torch 2.13.0+cpu is 2.13.0
    return pins


def changes(locked: dict[str, str], newest: dict[str, str]) -> list[str]:
    """One line per package whose release differs, that is new, or that is gone."""
    lines = []
    for name in sorted(set(locked) | set(newest)):
        a, b = locked.get(name), newest.get(name)
        if a == b:
            continue
        lines.append(f"  {name}: {a or '(not in the lock)'} -> {b or '(no longer installed)'}")
    return lines


def failures(junit: Path) -> tuple[int, list[str]]:
    """``(tests run, one line per failed or erroring test)`` from a JUnit XML report."""
    root = ET.parse(junit).getroot()
    ran, failed = 0, []
    for case in root.iter("testcase"):
        ran += 1
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                message = (bad.get("message") or bad.text or "").strip().splitlines()
                first = message[0][:200] if message else ""
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                failed.append(f"  {name}: {first}")
    return ran, failed


def latest(args: argparse.Namespace) -> int:
    venv = Path(args.venv)
    try:
        python = build(venv, [])
    except subprocess.CalledProcessError as err:
        print(f"latest: the environment with the newest releases could not be built ({err})")
        return 1
    locked, newest = read_lock(), freeze(python)
    diff = changes(locked, newest)
    print(f"\nreleases that differ from {LOCK.name} ({len(diff)}):")
    print("\n".join(diff) if diff else "  none: the lock is the newest")
    targets = [t for t in LATEST_TESTS + LATEST_NOTEBOOKS if (ROOT / t).exists()]
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "latest.xml"
        env = dict(os.environ, TQDM_DISABLE="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg",
                   PYTHONHASHSEED="0")
        env.pop("PYTHONPATH", None)
        run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "-n", "2",
             "--dist", "loadfile", f"--junitxml={junit}", *LATEST_LEFT_OUT, *targets],
            cwd=ROOT, env=env)
        ran, failed = failures(junit) if junit.exists() else (0, ["  the tests did not run"])
    print(f"\nunder the newest releases, {ran} tests and notebook cells of {', '.join(targets)}:")
    if failed:
        print(f"{len(failed)} fail (make test runs them under the lock; each needs a look before the lock moves):")
        print("\n".join(failed))
    else:
        print("all pass: the lock can move (python tools/lock.py write, then make test)")
    return 0


def write(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        python = build(Path(tmp) / "venv", args.pins)
        newest = freeze(python)
    old = read_lock()
    lines = header() + [f"{name}=={release}" for name, release in sorted(newest.items())]
    LOCK.write_text("\n".join(lines) + "\n")
    diff = changes(old, newest)
    print(f"\n{LOCK.name} rewritten; {len(diff)} releases moved:")
    print("\n".join(diff) if diff else "  none")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("latest", help="try the newest releases and report what changes")
    p.add_argument("--venv", default=str(ROOT / ".venv-latest"))
    p.set_defaults(func=latest)
    p = sub.add_parser("write", help="rewrite constraints.txt from a fresh resolution")
    p.add_argument("pins", nargs="*", help="exact pins to keep, e.g. transformers==5.24.0")
    p.set_defaults(func=write)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
