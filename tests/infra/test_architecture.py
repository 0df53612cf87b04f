"""The package's layers, checked by reading its source with ``ast`` (nothing is imported).

- No import cycles between accumlab's modules, inside a subpackage as well: imports inside
  functions count, and ``from P import x`` imports ``P`` itself (its ``__init__``), as does
  importing a submodule of ``P`` from outside ``P``.
- The core (what a reader copies) imports only the core.
- The layers do not import the driver (``train`` builds on them, not they on it).
- The library imports neither the course (``accumlab_course``, its own distribution in
  ``course/``) nor what only the course needs (matplotlib, ipywidgets, IPython).

See docs/ARCHITECTURE.md for the picture these rules keep true. The shape of a module is
set by the idea it holds, not by a line count: no test counts lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "accumlab"
ROOT = "accumlab"  # the facade: it imports every layer, and none of them builds on it

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


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(name: str, packages: set[str]) -> str | None:
    parent = name.rpartition(".")[0]
    return parent if parent in packages else None


def imports_in(source: str, name: str, is_package: bool, modules: set[str], packages: set[str]) -> set[str]:
    """The modules among ``modules`` that the module ``name`` runs by importing what its
    ``source`` imports, anywhere in it (functions included)."""
    found: set[str] = set()

    def imported(target: str) -> None:
        found.add(target)
        # Importing P.sub runs P's __init__ first; inside P, that __init__ is what imports
        # P's own submodules, so it counts only from outside.
        outer = package_of(target, packages)
        while outer is not None:
            if not (name == outer or name.startswith(outer + ".")):
                found.add(outer)
            outer = package_of(outer, packages)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            imported(prefix)  # `from P import x` reads x from P: P's __init__ runs and is used
            for alias in node.names:
                if f"{prefix}.{alias.name}" in modules:
                    imported(f"{prefix}.{alias.name}")
    return {m for m in found if m in modules and m != name}


def graph_of(package: Path) -> dict[str, set[str]]:
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    packages = {module_name(p, package) for p in package.rglob("__init__.py")}
    return {
        name: imports_in(path.read_text(), name, path.name == "__init__.py", set(paths), packages)
        for name, path in paths.items()
    }


def cycles_of(graph: dict[str, set[str]]) -> list[str]:
    """Each import ``a -> b`` from which ``a`` is reached again, as ``a -> b -> ... -> a``;
    the root package (the facade) is left out."""

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph[todo.pop()] - {ROOT}:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return sorted(
        f"{a} -> {b} -> ... -> {a}"
        for a in graph
        for b in graph[a]
        if ROOT not in (a, b) and a in reachable(b)
    )


GRAPH = graph_of(PACKAGE)


def test_the_core_modules_exist() -> None:
    assert CORE <= set(GRAPH), f"missing core modules: {sorted(CORE - set(GRAPH))}"


def test_no_import_cycles() -> None:
    cycles = cycles_of(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "accumlab"
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def test_a_submodule_reading_its_own_package_is_a_cycle(tmp_path: Path) -> None:
    """The shape checkpoint/__init__.py and checkpoint/resume.py once had: ``__init__``
    imports ``resume``, and ``resume`` imports a sibling through the package
    (``from . import replay``), so each needs the other half-imported."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "from . import checkpoint\n",
            "checkpoint/__init__.py": "from .replay import rng_state\nfrom .resume import Checkpointer\n",
            "checkpoint/replay.py": "def rng_state(): ...\n",
            "checkpoint/resume.py": "from . import replay\nclass Checkpointer: ...\n",
        },
    )
    graph = graph_of(root)
    assert "accumlab.checkpoint" in graph["accumlab.checkpoint.resume"]
    assert cycles_of(graph) == [
        "accumlab.checkpoint -> accumlab.checkpoint.resume -> ... -> accumlab.checkpoint",
        "accumlab.checkpoint.resume -> accumlab.checkpoint -> ... -> accumlab.checkpoint.resume",
    ]
    (root / "checkpoint/resume.py").write_text("from .replay import rng_state\nclass Checkpointer: ...\n")
    assert cycles_of(graph_of(root)) == []  # the fix: import the sibling module itself


def test_importing_a_submodule_from_outside_runs_its_package(tmp_path: Path) -> None:
    """``settings -> checkpoint.files`` runs ``checkpoint/__init__``, which imports
    ``resume``: if ``resume`` imports ``settings``, that is a cycle, though no import names
    the other module directly."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "settings.py": "from .checkpoint.files import check\n",
            "checkpoint/__init__.py": "from .files import check\nfrom .resume import Checkpointer\n",
            "checkpoint/files.py": "def check(): ...\n",
            "checkpoint/resume.py": "from ..settings import TrainSettings\n",
        },
    )
    graph = graph_of(root)
    assert graph["accumlab.settings"] == {"accumlab.checkpoint", "accumlab.checkpoint.files"}
    assert "accumlab.settings -> accumlab.checkpoint -> ... -> accumlab.settings" in cycles_of(graph)


@pytest.mark.parametrize("name", sorted(CORE))
def test_core_imports_only_core(name: str) -> None:
    above = sorted(m for m in GRAPH[name] if m not in CORE)
    assert not above, f"{name} (core) imports {above}: the core imports nothing above it"


def importers_of_the_driver(graph: dict[str, set[str]]) -> list[str]:
    """The modules that import ``accumlab.driver`` but sit below it: all but the facade."""
    return sorted(a for a in graph if "accumlab.driver" in graph[a] and a != ROOT)


def test_the_layers_do_not_import_the_driver() -> None:
    offenders = importers_of_the_driver(GRAPH)
    assert not offenders, f"{offenders} import accumlab.driver, which builds on them"


def test_a_layer_importing_the_driver_is_found(tmp_path: Path) -> None:
    """Also through a function-level import."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "from .driver import train\n",
            "driver.py": "from .oom import shrink\ndef train(): ...\n",
            "oom.py": "def shrink():\n    from .driver import train\n",
        },
    )
    assert importers_of_the_driver(graph_of(root)) == ["accumlab.oom"]


#: What the library never imports: the course, and what only the course needs.
COURSE_ONLY = ("accumlab_course", "matplotlib", "ipywidgets", "IPython")


def course_imports(package: Path) -> list[str]:
    """``module imports name`` for every import of :data:`COURSE_ONLY` under ``package``,
    functions included."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                if name.split(".")[0] in COURSE_ONLY:
                    found.append(f"{module_name(path, package)} imports {name}")
    return found


def test_the_library_does_not_import_the_course() -> None:
    offenders = course_imports(PACKAGE)
    assert not offenders, "\n".join(offenders)


def test_a_library_module_importing_the_course_is_found(tmp_path: Path) -> None:
    root = _package(tmp_path, {"__init__.py": "", "checks.py": "def f():\n    import matplotlib.pyplot\n",
                               "audit.py": "from accumlab_course.models import TinyGPT\n"})
    assert course_imports(root) == ["accumlab.audit imports accumlab_course.models",
                                    "accumlab.checks imports matplotlib.pyplot"]
