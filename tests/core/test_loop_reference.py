"""What the reference page (docs/site/reference/loop.md) says of the loop holds for
``accumlab/loop.py``: each of its two functions is under the number of code lines it
states, and the modules it says to copy with ``loop.py`` are the ones ``loop.py`` imports.

A line of code is a line of the function's body that is not blank, not a comment alone
and not part of its docstring; the signature is not counted.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOOP_PY = ROOT / "accumlab" / "loop.py"
PAGE = (ROOT / "docs" / "site" / "reference" / "loop.md").read_text(encoding="utf-8")


def code_lines(source: str, name: str) -> int:
    """The lines of code in the body of the top-level function ``name`` of ``source``."""
    tree = ast.parse(source)
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    body = function.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    first = body[1].lineno if has_docstring else body[0].lineno
    lines = source.splitlines()[first - 1 : function.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def test_code_lines_counts_the_body_without_docstring_blanks_and_comments() -> None:
    source = '''
def f(a,
      b):
    """Docstring,
    two lines."""
    # a comment
    x = a  # counted

    return (x +
            b)
'''
    assert code_lines(source, "f") == 3


@pytest.mark.parametrize("name", ["accumulate", "train_window"])
def test_each_function_is_under_the_lines_the_page_states(name: str) -> None:
    (stated,) = re.findall(r"each under (\d+) lines of\s+code", PAGE)
    assert code_lines(LOOP_PY.read_text(encoding="utf-8"), name) < int(stated)


def test_the_modules_to_copy_are_those_loop_py_imports() -> None:
    copying = PAGE.split("## Copying it", 1)[1]
    named = set(re.findall(r"`(\w+)\.py`", copying)) - {"loop"}
    tree = ast.parse(LOOP_PY.read_text(encoding="utf-8"))
    imported = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1}
    assert named == imported
