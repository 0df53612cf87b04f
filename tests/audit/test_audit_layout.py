"""The loop audit's and the split-invariance engine's place in the layers, read from the
source with ``ast``: they import the core's objectives (the engine also ``validate``) and
the two modules every audit shares (the table of mistakes and the fit), which import
nothing above torch; the loop audit's ``__init__`` re-exports nothing; inside each
subpackage each module imports only those its map lists before it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "accumlab"


def _accumlab_imports(path: Path) -> set[str]:
    """The accumlab modules (dotted, from the package root) that ``path`` imports."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - (node.level - 1)])
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif (node.module or "").startswith("accumlab"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("accumlab"))
    return found


def test_the_loop_audit_imports_only_objectives_and_the_shared_modules():
    allowed = {"accumlab.objectives", "accumlab.mistakes", "accumlab.least_squares"}
    for path in sorted((PACKAGE / "loop_audit").glob("*.py")):
        outside = {m for m in _accumlab_imports(path) if not m.startswith("accumlab.loop_audit")}
        assert outside <= allowed, (path.name, sorted(outside - allowed))


def test_the_shared_modules_are_leaves():
    for name in ("mistakes.py", "least_squares.py"):
        assert _accumlab_imports(PACKAGE / name) == set(), name


def test_the_subpackage_init_re_exports_nothing():
    tree = ast.parse((PACKAGE / "loop_audit" / "__init__.py").read_text())
    assert [type(node).__name__ for node in tree.body] == ["Expr"]  # its docstring only


def test_each_module_imports_only_the_ones_its_map_lists_before_it():
    """The subpackage's docstring lists its modules in order (its map); each imports only
    modules listed before it, so the subpackage has no import cycle."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "loop_audit" / "__init__.py").read_text()))
    order = list(dict.fromkeys(re.findall(r":mod:`\.(\w+)`", doc)))
    on_disk = {p.stem for p in (PACKAGE / "loop_audit").glob("*.py")} - {"__init__"}
    assert sorted(order) == sorted(on_disk), "the map lists every module once"
    for i, name in enumerate(order):
        inside = {
            m.removeprefix("accumlab.loop_audit.")
            for m in _accumlab_imports(PACKAGE / "loop_audit" / f"{name}.py")
            if m.startswith("accumlab.loop_audit.")
        }
        assert inside <= set(order[:i]), (name, sorted(inside - set(order[:i])))


def test_the_engine_imports_only_the_shared_modules_and_the_core_it_names():
    allowed = {"accumlab.objectives", "accumlab.validate", "accumlab.mistakes",
               "accumlab.least_squares"}
    for path in sorted((PACKAGE / "invariance").glob("*.py")):
        outside = {m for m in _accumlab_imports(path) if not m.startswith("accumlab.invariance")}
        assert outside <= allowed, (path.name, sorted(outside - allowed))


def test_each_engine_module_imports_only_the_ones_its_map_lists_before_it():
    doc = ast.get_docstring(ast.parse((PACKAGE / "invariance" / "__init__.py").read_text()))
    order = list(dict.fromkeys(re.findall(r"^- :mod:`\.(\w+)`", doc, re.MULTILINE)))
    on_disk = {p.stem for p in (PACKAGE / "invariance").glob("*.py")} - {"__init__"}
    assert sorted(order) == sorted(on_disk), "the map lists every module once"
    for i, name in enumerate(order):
        inside = {
            m.removeprefix("accumlab.invariance.")
            for m in _accumlab_imports(PACKAGE / "invariance" / f"{name}.py")
            if m.startswith("accumlab.invariance.")
        }
        assert inside <= set(order[:i]), (name, sorted(inside - set(order[:i])))
