"""The package's layers, checked by reading its source with ``ast`` (nothing is imported).

- No import cycles between accumlab's modules (imports inside functions count).
- The core (what a reader copies) imports only the core, and the core loop module with
  everything it reaches adds up to at most 1,000 lines, docstrings included.
- ``accumulate`` and ``train_window`` each have at most 40 lines of code (docstring,
  blank lines and comments not counted).
- Nothing outside ``accumlab/course`` imports the course material.
See docs/ARCHITECTURE.md for the picture these rules keep true.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "accumlab"

#: The core layer: the modules an engineer copies to get the whole update.
CORE = {
    "accumlab.plan",
    "accumlab.objectives",
    "accumlab.precision",
    "accumlab.report",
    "accumlab.parallel",
    "accumlab.loop",
    "accumlab.validate",
}
CORE_LOOP = "accumlab.loop"
CORE_LINE_BUDGET = 1000
FUNCTION_CODE_LINES = 40


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = current.split(".") if is_package else current.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    found = []
    for alias in node.names:
        candidate = f"{prefix}.{alias.name}"
        found.append(candidate if candidate in MODULES else prefix)
    return found


def imports_of(name: str) -> set[str]:
    """accumlab modules that ``name`` imports anywhere in its source (functions included)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.update(_resolve(name, is_package, node))
    # a submodule import also runs its package's __init__; only the module itself counts here
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def reachable(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_core_modules_exist() -> None:
    assert CORE <= set(MODULES), f"missing core modules: {sorted(CORE - set(MODULES))}"


def test_no_import_cycles() -> None:
    cycles = sorted(
        f"{a} -> {b} -> ... -> {a}"
        for a in GRAPH
        for b in GRAPH[a]
        if a in reachable(b) and a != "accumlab" and b != "accumlab"
    )
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("name", sorted(CORE))
def test_core_imports_only_core(name: str) -> None:
    above = sorted(m for m in GRAPH[name] if m not in CORE)
    assert not above, f"{name} (core) imports {above}: the core imports nothing above it"


def test_core_loop_fits_the_line_budget() -> None:
    files = [MODULES[m] for m in {CORE_LOOP} | reachable(CORE_LOOP)]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert lines <= CORE_LINE_BUDGET, (
        f"the core loop and what it imports hold {lines} lines "
        f"({', '.join(sorted(p.name for p in files))}); budget {CORE_LINE_BUDGET}"
    )


def code_lines(source: str, node: ast.FunctionDef) -> int:
    """Lines of ``node``'s body that hold code: no docstring, comments or blank lines."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if not body:
        return 0
    first, last = body[0].lineno, body[-1].end_lineno or body[-1].lineno
    text = "\n".join(source.splitlines()[first - 1 : last])
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


@pytest.mark.parametrize("function", ["accumulate", "train_window"])
def test_the_loop_functions_read_on_one_screen(function: str) -> None:
    source = MODULES[CORE_LOOP].read_text()
    tree = ast.parse(source)
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    n = code_lines(source, node)
    assert n <= FUNCTION_CODE_LINES, f"{function} has {n} code lines; at most {FUNCTION_CODE_LINES}"


def test_code_lines_counts_code_only() -> None:
    source = 'def f(x):\n    """Doc."""\n\n    # a comment\n    y = (x +\n         1)\n    return y\n'
    (node,) = ast.parse(source).body
    assert code_lines(source, node) == 3


def test_the_library_does_not_import_the_course() -> None:
    offenders = sorted(
        f"{a} imports {b}"
        for a in GRAPH
        if not a.startswith("accumlab.course") and a not in ("accumlab.cli",)
        for b in GRAPH[a]
        if b.startswith("accumlab.course")
    )
    assert not offenders, "\n".join(offenders)
