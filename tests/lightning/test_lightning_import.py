"""Lightning is optional: ``import accumlab`` (with its split-invariance engine and its
testing helpers) never imports it, nor pytest; without it ``import accumlab.lightning``
fails in one line naming the extra. One subprocess, so this process's imports cannot hide
an import."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import accumlab, accumlab.invariance, accumlab.testing
loaded = sorted(m for m in ("lightning", "pytorch_lightning", "transformers", "pytest") if m in sys.modules)
print("loaded:", loaded)
sys.modules["lightning"] = None  # as if Lightning were not installed
try:
    import accumlab.lightning
except ImportError as exc:
    print("error:", exc)
"""


def test_accumlab_never_imports_lightning_and_the_extra_is_named():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout
    assert "loaded: []" in out, out
    assert ("error: accumlab.lightning needs Lightning: pip install 'accumlab[lightning]' "
            "(lightning>=2.4)") in out, out
