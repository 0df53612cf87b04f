"""Checks that a committed notebook ships its exercises unsolved (a helper, not a test file).

An exercise ``exNN.<name>`` is unsolved in a notebook when

- the learner's cell holds a stub: ``def <answer>(...)`` whose body is only a docstring
  and ``raise NotImplementedError(...)``, or ``<answer> = ...``;
- exactly one cell calls ``exNN.<name>.check(<answer>)`` as a plain statement or
  assignment (``passed = ...``; no ``assert``, so the notebook runs on), and its saved
  output is the checker's "○ <name>: not attempted yet" line;
- no cell asserts that the check passes (``assert exNN.<name>.check(``).

Cells that show the checker naming a wrong answer (``assert not exNN.<name>.check(x)``)
are allowed.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from accumlab_course.exercises import NOT_ATTEMPTED

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _code_cells(notebook: str) -> list[dict[str, Any]]:
    data = json.loads((NOTEBOOKS / notebook).read_text(encoding="utf-8"))
    cells = [c for c in data["cells"] if c["cell_type"] == "code"]
    for c in cells:
        c["text"] = "".join(c["source"])
    return cells


def _stream_text(cell: dict[str, Any]) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


def _is_stub_definition(tree: ast.Module, answer: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == answer:
            body = list(node.body)
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # a docstring
            if len(body) != 1 or not isinstance(body[0], ast.Raise):
                return False
            raised = body[0].exc
            name = raised.func if isinstance(raised, ast.Call) else raised
            return isinstance(name, ast.Name) and name.id == "NotImplementedError"
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == answer for t in node.targets
        ):
            return isinstance(node.value, ast.Constant) and node.value.value is Ellipsis
    return False


def _defines(tree: ast.Module, answer: str) -> bool:
    return any(
        (isinstance(node, ast.FunctionDef) and node.name == answer)
        or (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == answer for t in node.targets)
        )
        for node in tree.body
    )


def assert_unsolved(notebook: str, exercises: dict[str, str]) -> None:
    """Assert that every ``{name: module}`` exercise is shipped unsolved in ``notebook``."""
    cells = _code_cells(notebook)
    for name, module in exercises.items():
        call = f"{module}.{name}.check("
        assert not any(f"assert {call}" in c["text"] for c in cells), (
            f"{notebook}: a cell asserts that {call}...) passes; the committed notebook "
            "must not hold a working answer"
        )
        bare = re.compile(rf"^(?:\w+ = )?{re.escape(call)}(\w+)\)\s*$", re.MULTILINE)
        checkers = [(c, m.group(1)) for c in cells for m in bare.finditer(c["text"])]
        assert len(checkers) == 1, f"{notebook}: expected one cell calling {call}answer)"
        checker, answer = checkers[0]
        expected = f"○ {name}: {NOT_ATTEMPTED}"
        assert expected in _stream_text(checker), (
            f"{notebook}: the saved output of the {call}{answer}) cell is not {expected!r}"
        )
        definitions = [c for c in cells if _defines(ast.parse(_python(c["text"])), answer)]
        assert len(definitions) == 1, f"{notebook}: expected one cell defining {answer}"
        assert _is_stub_definition(ast.parse(_python(definitions[0]["text"])), answer), (
            f"{notebook}: {answer} is not a stub (a body that only raises "
            "NotImplementedError, or `= ...`)"
        )


def _python(source: str) -> str:
    """The cell without IPython magics, so ``ast`` can parse it."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())
