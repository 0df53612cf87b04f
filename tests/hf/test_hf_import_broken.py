"""An installed transformers that fails to import is named as broken, with its own error
as the cause, not reported as missing (``from None`` dropped the cause). A fresh
interpreter, as in test_hf_audit_import.py: this one may have imported transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_broken_transformers_is_not_called_missing(tmp_path: Path) -> None:
    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text("from torch import a_name_torch_does_not_have\n")
    done = subprocess.run(
        [sys.executable, "-c",
         f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
         "try:\n"
         "    import accumlab.hf\n"
         "except ImportError as err:\n"
         "    print(str(err))\n"
         "    print(repr(err.__cause__))\n"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    message, cause = done.stdout.splitlines()
    assert message == (
        "accumlab.hf: transformers is installed but fails to import (cannot import name "
        f"'a_name_torch_does_not_have' from 'torch' ({Path(__import__('torch').__file__)})); "
        "reinstall it with pip install 'accumlab[hf]'"
    )
    assert cause.startswith("ImportError(\"cannot import name 'a_name_torch_does_not_have'")
