"""No exercise is answered by a function that a cell above its stub already defines.

For every notebook (discovered by glob, so a new lesson is covered as it lands) and every
exercise whose stub is a function (``def answer(...): raise NotImplementedError``), the
functions defined by the code cells above the stub are offered to that exercise's checker
(the one the cell under the stub calls, ``exNN.<name>.check(answer)``): none may pass. A
learner who copies a cell printed above the exercise has not done it.

How the cells are run, and why that is enough. Executing every cell above a stub would
train models and spawn processes (minutes per notebook). A function passes a checker only
through what it does with the arguments the checker hands it, so what it needs from the
notebook is its definition and the names it reads: the imports, the other functions and
classes, and the constants and objectives bound at the top level. The test therefore
executes, cell by cell in notebook order, every top-level import, ``def`` and ``class``,
and every assignment whose right-hand side calls nothing but a few builtins and an
objective's constructor (``al.NextTokenLoss()``); a statement that fails (a name bound by
a skipped, heavy statement) is left out, and a function that reads such a name then fails
when called, as it would not pass the checker on the checker's own inputs. A candidate
whose signature cannot take the stub's positional arguments is not offered: the checker's
call would raise ``TypeError``. The source of every cell is registered with ``linecache``
so ``inspect.getsource`` works (notebook 04's checker sends an answer's source to its
ranks).

This catches cases such as notebook 07's ``hf_style_window`` (a cell above the
``fixed_window`` stub) passed the audit checker unchanged.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import json
import linecache
import re
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CHECK = re.compile(r"^(?:\w+ = )?(ex\d\d)\.(\w+)\.check\((\w+)\)\s*$", re.MULTILINE)
#: Calls an assignment may make and still be executed here (cheap and side-effect free).
CHEAP_CALLS = {"len", "float", "int", "str", "range", "list", "dict", "tuple", "sum", "min",
               "max", "abs", "round", "sorted", "set"}


def _python(source: str) -> str:
    """The cell without IPython magics, so ``ast`` can parse it."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def _code_cells(path: Path) -> list[str]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return [_python("".join(c["source"])) for c in data["cells"] if c["cell_type"] == "code"]


def _stub(tree: ast.Module, answer: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == answer:
            body = [n for n in node.body if not (
                isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Raise):
                return node
    return None


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _cheap(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
        calls = [n for n in ast.walk(node.value) if isinstance(n, ast.Call)]
        return all(_call_name(c) in CHEAP_CALLS or _call_name(c).endswith("Loss")
                   for c in calls)
    return False


def exercises() -> list[tuple[str, str, str, str, int]]:
    """(notebook, module, exercise, answer name, index of the stub's code cell)."""
    found = []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        cells = _code_cells(path)
        for text in cells:
            for module, name, answer in CHECK.findall(text):
                stubs = [i for i, c in enumerate(cells) if _stub(ast.parse(c), answer)]
                if stubs:
                    found.append((path.name, module, name, answer, stubs[0]))
    return found


def _positional(node: ast.FunctionDef) -> int:
    return len(node.args.posonlyargs) + len(node.args.args)


def candidates(notebook: str, before: int, arity: int) -> dict[str, Any]:
    """Every function the code cells above cell ``before`` define, built in notebook order
    (cheap statements only, see the module docstring), that can take ``arity``
    positional arguments."""
    namespace: dict[str, Any] = {"__name__": "__notebook__"}
    defined: dict[str, Any] = {}
    for index, text in enumerate(_code_cells(NOTEBOOKS / notebook)[:before]):
        filename = f"<{notebook} code cell {index}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        for node in ast.parse(text).body:
            if not _cheap(node):
                continue
            code = compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")
            try:
                exec(code, namespace)  # noqa: S102 - the course's own committed cells
            except Exception:  # a name from a skipped statement: leave this one out
                continue
            if isinstance(node, ast.FunctionDef):
                defined[node.name] = namespace[node.name]
    usable = {}
    for name, fn in defined.items():
        try:
            inspect.signature(fn).bind(*range(arity))
        except TypeError:
            continue
        usable[name] = fn
    return usable


CASES = exercises()


def test_every_notebook_exercise_is_found():
    # The discovery above must see the course's function exercises, or this test is empty.
    names = {(nb[:2], name) for nb, _, name, _, _ in CASES}
    assert {("04", "uneven_window"), ("06", "contrastive_window"),
            ("07", "fixed_window"), ("05", "plan_under_budget")} <= names


@pytest.mark.parametrize(("notebook", "module", "name", "answer", "stub_cell"), CASES,
                         ids=[f"{c[0][:2]}-{c[2]}" for c in CASES])
def test_no_function_above_the_stub_passes(notebook, module, name, answer, stub_cell):
    stub = _stub(ast.parse(_code_cells(NOTEBOOKS / notebook)[stub_cell]), answer)
    exercise = getattr(importlib.import_module(f"accumlab_course.exercises.{module}"), name)
    passing = []
    for fn_name, fn in candidates(notebook, stub_cell, _positional(stub)).items():
        with contextlib.redirect_stdout(io.StringIO()):
            if exercise.check(fn):
                passing.append(fn_name)
    assert not passing, (
        f"{notebook}: {module}.{name} passes {passing}, defined in a cell above its stub: "
        "the exercise is answered before the learner writes anything"
    )
