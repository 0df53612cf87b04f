"""The loop audit's place in the layers, read from the source with ``ast``: it imports the
core's objectives and the two modules it shares with the Trainer audit (the table of
mistakes and the fit), which import nothing above torch; its ``__init__`` re-exports
nothing."""

from __future__ import annotations

import ast
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
