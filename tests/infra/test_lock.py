"""The lock (constraints.txt): the course's environment at exact releases.

``make lab``, ``make test``, ``make site`` and .ci/run install with ``-c constraints.txt``,
so a release published upstream changes nothing until the lock moves. These tests hold
the lock to that: exact pins only, the environment the tests run in is the lock's (every
installed distribution at its locked release), PyTorch's release is the one the Makefile
installs, and the transformers releases the Trainer audit names as tested are the lock's
and the older ones the slow tier installs.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
from pathlib import Path

import lock  # tools/lock.py (pyproject puts tools/ on the path)
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_line_is_an_exact_pin():
    pins = lock.read_lock()
    assert len(pins) > 100 and pins["torch"] == "2.13.0"
    for name in ("transformers", "trl", "peft", "accelerate", "datasets", "lightning",
                 "jupyterlab", "nbval", "pytest", "sphinx", "ruff", "matplotlib", "ipywidgets"):
        assert name in pins, name


def test_a_line_that_is_not_an_exact_pin_is_refused(tmp_path):
    bad = tmp_path / "c.txt"
    bad.write_text("# header\ntorch==2.13.0\ntransformers>=5\n")
    with pytest.raises(ValueError, match="transformers>=5.*not an exact pin"):
        lock.read_lock(bad)


def test_the_environment_is_the_lock():
    """Every distribution installed here (but pip and the project itself) is in the lock at
    exactly its release: a package added to an extra without moving the lock fails here."""
    pins = lock.read_lock()
    off = []
    for dist in md.distributions():
        name = lock.normalize(dist.metadata["Name"])
        if name in ("pip", "accumlab", "accumlab-course"):
            continue
        version = dist.version.split("+", 1)[0]
        if pins.get(name) != version:
            off.append(f"{name} {version} (lock: {pins.get(name, 'missing')})")
    assert not off, "installed but not as locked: " + ", ".join(sorted(off))


def test_the_makefile_installs_the_locks_torch():
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "VENV=/nonexistent/venv", "check"],
                         capture_output=True, text=True, check=True).stdout
    assert '"torch==2.13.0"' in out
    assert all("-c constraints.txt" in line for line in out.splitlines()
               if " -m pip install " in line), out


def test_the_tested_transformers_releases_are_the_locks_and_the_slow_tiers():
    ah = pytest.importorskip("accumlab.hf")
    makefile = (ROOT / "Makefile").read_text()
    old = re.search(r"^HF_OLD := (.+)$", makefile, re.M).group(1).split()
    assert ah.TESTED_TRANSFORMERS == (*old, lock.read_lock()["transformers"])
    # each old release's folder gets exact pins of what it needs
    for release in old:
        pins = re.search(rf"^HF_PINS_{re.escape(release)} := (.+)$", makefile, re.M).group(1)
        assert pins and all("==" in p for p in pins.split()), (release, pins)


def test_latest_reports_each_moved_release_and_each_failure(tmp_path):
    """What `make latest` prints, from its two pure parts: the releases that differ from
    the lock (moved, new, gone) and one line per failed test of a JUnit report."""
    assert lock.changes({"torch": "2.13.0", "transformers": "5.24.0", "gone": "1"},
                        {"torch": "2.13.0", "transformers": "5.25.0", "kernels": "0.19.1"}) == [
        "  gone: 1 -> (no longer installed)",
        "  kernels: (not in the lock) -> 0.19.1",
        "  transformers: 5.24.0 -> 5.25.0",
    ]
    junit = tmp_path / "r.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.hf.test_a" name="test_ok"/>'
        '<testcase classname="tests.hf.test_a" name="test_bad"><failure message="assert 1 == 2&#10;more"/></testcase>'
        '<testcase classname="nb" name="Cell 5"><error message="cell failed"/></testcase>'
        '</testsuite></testsuites>')
    assert lock.failures(junit) == (3, ["  tests.hf.test_a::test_bad: assert 1 == 2",
                                        "  nb::Cell 5: cell failed"])


def test_lesson_09_describes_the_locks_releases():
    """Lesson 09 measures each framework at the release it names (its PINNED), and says so
    where another is installed: those releases are the lock's."""
    import ast
    import json

    cells = json.loads((ROOT / "notebooks" / "09_who_divides_by_what.ipynb").read_text())["cells"]
    (source,) = ["".join(c["source"]) for c in cells if "PINNED = {" in "".join(c["source"])]
    tree = ast.parse(source)
    (pinned,) = [ast.literal_eval(n.value) for n in ast.walk(tree)
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PINNED"]
    locked = lock.read_lock()
    assert pinned and all(locked[lock.normalize(name)] == release for name, release in pinned.items())
