"""The oldest PyTorch accumlab runs on, checked when the package is imported.

``pyproject.toml`` declares the same floor (``torch>=2.6``) for pip; this check catches an
environment where an older torch was installed anyway (``--no-deps``, a conda pin), and
says so in one line instead of failing later with an ``AttributeError`` deep in a module.
Versions are compared as integer tuples, never as strings ("2.10" sorts before "2.6" as
text).
"""

from __future__ import annotations

import re

#: Oldest supported (major, minor). The package needs ``torch.OutOfMemoryError`` (new in
#: 2.5) and ``fully_shard`` importable from ``torch.distributed.fsdp`` (public in 2.6).
MIN_TORCH: tuple[int, int] = (2, 6)
_NEEDS = (
    "torch.OutOfMemoryError (added in 2.5) and torch.distributed.fsdp.fully_shard "
    "(public since 2.6)"
)
_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def release_tuple(version: str) -> tuple[int, int, int]:
    """The ``(major, minor, patch)`` release numbers at the start of a version string.

    Local and pre-release suffixes are dropped: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``,
    ``"2.6.0a0+git1234"`` -> ``(2, 6, 0)``, ``"2.7"`` -> ``(2, 7, 0)``. A pre-release of
    X.Y therefore counts as X.Y: it already carries the APIs the floor is about.
    """
    if not isinstance(version, str):
        raise TypeError(f"version must be a str such as '2.6.0', got {type(version).__name__}")
    match = _RELEASE.match(version.strip())
    if match is None:
        raise ValueError(
            f"version {version!r} does not start with MAJOR.MINOR (for example '2.6.0+cpu')"
        )
    major, minor, patch = match.groups(default="0")
    return int(major), int(minor), int(patch)


def check_torch_version(version: str | None = None, minimum: tuple[int, int] = MIN_TORCH) -> None:
    """Raise ``ImportError`` when ``version`` (default: the installed torch) is below ``minimum``.

    ``minimum`` is ``(major, minor)``; the comparison is on integer tuples.
    """
    if version is None:
        import torch

        version = str(torch.__version__)
    if release_tuple(version)[:2] < tuple(minimum):
        floor = ".".join(map(str, minimum))
        raise ImportError(
            f"accumlab needs PyTorch >= {floor} but found torch {version}: it uses {_NEEDS}. "
            f"Upgrade with `pip install --upgrade 'torch>={floor}'`."
        )
