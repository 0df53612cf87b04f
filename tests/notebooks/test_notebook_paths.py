"""No committed notebook holds a path of the machine that saved it.

A saved output such as ``python 3.11.7 (/home/ada/course/.venv/bin/python)`` shows a
reader someone else's machine, names a user, and makes strict nbval fail on every other
machine. Images are skipped (base64 text can spell anything).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Absolute paths under the usual home, work and temporary prefixes (POSIX, macOS, Windows).
MACHINE_PATH = re.compile(
    r"(?<![\w.])(?:/home/|/Users/|/root/|/work/|/tmp/|/var/folders/|/private/var/|/mnt/"
    r"|/opt/conda|/opt/homebrew|/usr/local/lib/python|[A-Za-z]:\\\\(?:Users|Documents and Settings)\\\\)"
    r"[^\s\"'<>)]*"
)


def machine_paths(text: str) -> list[str]:
    return sorted(set(MACHINE_PATH.findall(text)))


def notebook_text(path: Path) -> str:
    """Sources and text outputs of every cell, without image payloads."""
    parts = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            parts.append("".join(output.get("text", "")))
            parts.append("".join(output.get("traceback", [])))
            for mime, data in output.get("data", {}).items():
                if not mime.startswith("image/"):
                    parts.append(data if isinstance(data, str) else json.dumps(data))
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_machine_path_in_a_committed_notebook(path):
    found = machine_paths(notebook_text(path))
    assert not found, f"{path.name} holds machine paths: {found[:3]}"


@pytest.mark.parametrize("text", [
    "python 3.11.7 (/work/main/.venv/bin/python)",
    "saved to /home/ada/runs/record.json",
    "/Users/ada/Library/x.ipynb",
    "tempdir /tmp/tmpab12cd/ckpt",
    r"C:\\Users\\ada\\course",
    "/var/folders/xy/T/abc",
])
def test_the_pattern_finds_machine_paths(text):
    assert machine_paths(text)


@pytest.mark.parametrize("text", [
    "notebooks/00_start_here.ipynb", "../accumlab/loop.py", "runs/ckpt/checkpoint-5.pt",
    "the ratio 1/tmp", "https://github.com/accumlab/accumlab/tree/main/notebooks",
])
def test_the_pattern_leaves_relative_paths_and_urls_alone(text):
    assert not machine_paths(text)
