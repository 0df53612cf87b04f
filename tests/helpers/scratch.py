"""Scratch folders for what the tests must name but never read (a Trainer's ``output_dir``):
made inside one folder per process, which is removed when the process exits, so a test
run leaves nothing in the system's temporary directory."""

from __future__ import annotations

import tempfile

_ROOT = tempfile.TemporaryDirectory(prefix="accumlab-tests-")  # its finalizer removes it at exit


def scratch_dir(prefix: str) -> str:
    """A new empty folder, removed with this process's scratch root."""
    return tempfile.mkdtemp(prefix=prefix, dir=_ROOT.name)
