"""The loop audit's and the split-invariance engine's place in the layers, read from the
source with ``ast``: they import the core's objectives (the engine also ``validate``) and
the two modules every audit shares (the table of mistakes and the fit), which import
nothing above torch; the loop audit's ``__init__`` re-exports nothing; inside each
subpackage each module imports only those its map lists before it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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


#: subpackage -> the modules outside it that it may import: the core's objectives (the
#: engine also validate) and the two modules every audit shares
ALLOWED = {
    "loop_audit": {"accumlab.objectives", "accumlab.mistakes", "accumlab.least_squares"},
    "invariance": {"accumlab.objectives", "accumlab.validate", "accumlab.mistakes",
                   "accumlab.least_squares"},
}


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_each_audit_imports_only_the_shared_modules_and_the_core_it_names(subpackage):
    for path in sorted((PACKAGE / subpackage).glob("*.py")):
        outside = {m for m in _accumlab_imports(path) if not m.startswith(f"accumlab.{subpackage}")}
        assert outside <= ALLOWED[subpackage], (path.name, sorted(outside - ALLOWED[subpackage]))


def test_the_shared_modules_are_leaves():
    for name in ("mistakes.py", "least_squares.py"):
        assert _accumlab_imports(PACKAGE / name) == set(), name


def test_the_subpackage_init_re_exports_nothing():
    tree = ast.parse((PACKAGE / "loop_audit" / "__init__.py").read_text())
    assert [type(node).__name__ for node in tree.body] == ["Expr"]  # its docstring only


def _map(subpackage: str) -> list[str]:
    """The modules the subpackage's docstring lists in its map (its lines that start with
    ``- :mod:``), in order."""
    doc = ast.get_docstring(ast.parse((PACKAGE / subpackage / "__init__.py").read_text()))
    listed = [re.findall(r":mod:`\.(\w+)`", line) for line in doc.splitlines() if line.startswith("- :mod:")]
    return list(dict.fromkeys(name for names in listed for name in names))


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_each_module_imports_only_the_ones_its_map_lists_before_it(subpackage):
    """The subpackage's docstring lists its modules in order (its map); each imports only
    modules listed before it, so the subpackage has no import cycle."""
    order = _map(subpackage)
    on_disk = {p.stem for p in (PACKAGE / subpackage).glob("*.py")} - {"__init__"}
    assert sorted(order) == sorted(on_disk), "the map lists every module once"
    for i, name in enumerate(order):
        inside = {
            m.removeprefix(f"accumlab.{subpackage}.")
            for m in _accumlab_imports(PACKAGE / subpackage / f"{name}.py")
            if m.startswith(f"accumlab.{subpackage}.")
        }
        assert inside <= set(order[:i]), (name, sorted(inside - set(order[:i])))
