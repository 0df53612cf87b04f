"""Notebook 08 installs what pyproject's ``hf`` extra requires: the same packages, at the
extra's oldest releases or later (the lesson's outputs hold from its own oldest
transformers on, which the slow test runs it under), so a learner's environment and
``pip install "accumlab[hf]"`` cannot disagree."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _install_cell_needs() -> dict[str, str]:
    cells = json.loads((REPO / "notebooks" / "08_audit_your_job.ipynb").read_text())["cells"]
    (source,) = [
        "".join(c["source"]) for c in cells if "needed = {" in "".join(c.get("source", ""))
    ]
    needed = ast.literal_eval(re.search(r"^needed = (\{.*\})$", source, re.M).group(1))
    return {name: f"{name}>={a}.{b}" for name, (a, b) in needed.items()}


def test_the_install_cell_asks_for_what_the_hf_extra_requires():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = {r.name: r for r in map(Requirement, project["optional-dependencies"]["hf"])}
    cell = {r.name: r for r in map(Requirement, _install_cell_needs().values())}
    assert cell.keys() == extra.keys()
    for name, needed in cell.items():  # the lesson asks for the extra's release or a later one
        (floor,) = needed.specifier
        assert floor.version in extra[name].specifier, (name, str(needed), str(extra[name]))


@pytest.mark.slow
def test_lesson_08_holds_under_the_oldest_release_the_extra_allows():
    """make test runs every notebook under the environment's transformers (the newest);
    this runs 08 under strict nbval with the oldest release the ``hf`` extra allows first on
    ``PYTHONPATH`` (the folder ``make unit`` installs it in), so a learner whose hosted
    service has that release sees the saved outputs."""
    import subprocess
    import sys

    from helpers import hf_releases

    release = hf_releases.release_of(_install_cell_needs()["transformers"].split(">=")[1])
    env = hf_releases.subprocess_env(release)  # fails the test when the folder is missing
    probe = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == release
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
         "notebooks/08_audit_your_job.ipynb"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:]
