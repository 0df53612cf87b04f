"""The older transformers releases the slow tier runs the audit under: where each lives.

``make slow`` installs each release of ``HF_OLD`` in the Makefile into its own folder,
``<ACCUMLAB_HF_DIR>/hf-transformers-<release>`` (``ACCUMLAB_HF_DIR`` defaults to the
virtual environment's ``sys.prefix``: ``.venv``), never into the environment. A test runs
code under a release in a subprocess with that folder first on ``PYTHONPATH``
(:func:`subprocess_env`). The tests that need a folder are slow-tier tests, and a missing
folder fails them (:func:`installed`): the slow tier exists to run them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

#: The tests folder: the subprocess imports ``helpers.*`` from it.
TESTS = Path(__file__).resolve().parents[1]


def older_releases() -> tuple[str, ...]:
    """The releases of ``accumlab.hf.TESTED_TRANSFORMERS`` other than the environment's."""
    import transformers

    from accumlab.hf import TESTED_TRANSFORMERS

    return tuple(r for r in TESTED_TRANSFORMERS if r != transformers.__version__)


def folder(release: str) -> Path:
    """Where ``make slow`` installs ``release``."""
    return Path(os.environ.get("ACCUMLAB_HF_DIR", sys.prefix)) / f"hf-transformers-{release}"


def installed(release: str) -> Path:
    """The folder of ``release``; the calling test fails when it is not installed."""
    where = folder(release)
    if not (where / "transformers").is_dir():
        pytest.fail(f"transformers {release} is not installed in {where}: run make slow (it installs "
                    "it), or point ACCUMLAB_HF_DIR at the folder that holds hf-transformers-<release>")
    return where


def release_of(minor: str) -> str:
    """The tested release of the ``minor`` series (``"4.57"`` -> ``"4.57.6"``)."""
    (release,) = [r for r in older_releases() if r.startswith(minor + ".")]
    return release


def subprocess_env(release: str) -> dict[str, str]:
    """The environment of a subprocess that imports ``release`` (and ``helpers.*``), the
    folder first on ``PYTHONPATH``, before what the caller's ``PYTHONPATH`` holds."""
    paths = [str(installed(release)), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), TQDM_DISABLE="1", OMP_NUM_THREADS="1")


__all__ = ["TESTS", "folder", "installed", "older_releases", "release_of", "subprocess_env"]
