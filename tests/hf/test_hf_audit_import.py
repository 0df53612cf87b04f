"""transformers is optional: ``import accumlab`` never imports it, and ``import accumlab.hf``
without it fails with one line naming the extra to install. Each check runs in a fresh
interpreter (this one may have imported transformers already)."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_accumlab_does_not_import_transformers():
    done = run("import sys, accumlab, accumlab.checks; print('transformers' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_accumlab_hf_without_transformers_names_the_extra_in_one_line():
    # None in sys.modules makes `import transformers` fail as if it were not installed
    done = run(
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    import accumlab.hf\n"
        "except ImportError as err:\n"
        "    print(repr(str(err)), err.__cause__ is None, err.__suppress_context__)\n"
    )
    assert done.returncode == 0, done.stderr
    message, no_cause, suppressed = done.stdout.strip().rsplit(" ", 2)
    assert "pip install 'accumlab[hf]'" in message and "\\n" not in message
    assert (no_cause, suppressed) == ("True", "True")
    # uncaught, the user sees the one line (the inner ImportError is not chained)
    done = run("import sys\nsys.modules['transformers'] = None\nimport accumlab.hf")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: accumlab.hf needs Hugging Face transformers: pip install 'accumlab[hf]'"
    )
    assert "During handling" not in done.stderr


def test_the_oldest_release_has_one_home_and_the_extra_follows_it():
    """accumlab.hf.OLDEST_TRANSFORMERS is the one statement of the oldest transformers the
    audit runs on: the import refuses anything older, the hf extra asks for exactly it, and
    it is the series of the oldest release the tests run."""
    import pytest

    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("transformers")
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    import accumlab.hf as ah

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["hf"]
    (transformers,) = [r for r in map(Requirement, extra) if r.name == "transformers"]
    assert str(transformers.specifier) == f">={ah.OLDEST_TRANSFORMERS}"
    oldest_tested = min(ah.TESTED_TRANSFORMERS, key=Version)
    assert oldest_tested.startswith(ah.OLDEST_TRANSFORMERS + ".")
    assert not ah._too_old(oldest_tested) and ah._too_old("4.45.2")
