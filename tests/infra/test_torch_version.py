"""The torch floor: parsed-version comparison, the import-time check, and pyproject."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from accumlab._torch_version import MIN_TORCH, check_torch_version, release_tuple

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.6.0", (2, 6, 0)),
        ("2.6.0a0+git1234abc", (2, 6, 0)),
        ("2.7.0.dev20250310+cu126", (2, 7, 0)),
        ("2.8", (2, 8, 0)),
        (" 10.2.3 ", (10, 2, 3)),
    ],
)
def test_release_tuple(version: str, expected: tuple[int, int, int]) -> None:
    assert release_tuple(version) == expected


def test_release_tuple_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        release_tuple("nightly")
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        release_tuple("2")
    with pytest.raises(TypeError, match="version must be a str"):
        release_tuple(2.6)  # type: ignore[arg-type]


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0a0", "2.6.3+cpu", "2.10.0", "2.13.0", "3.0.0"])
def test_versions_at_or_above_the_floor_pass(version: str) -> None:
    # "2.10.0" < "2.6" as strings: the check must compare numbers.
    check_torch_version(version, minimum=(2, 6))


@pytest.mark.parametrize("version", ["2.5.1", "2.4.0+cu121", "1.13.1", "2.0.0"])
def test_versions_below_the_floor_raise_a_clear_import_error(version: str) -> None:
    with pytest.raises(ImportError) as info:
        check_torch_version(version, minimum=(2, 6))
    message = str(info.value)
    assert f"found torch {version}" in message
    assert "PyTorch >= 2.6" in message
    assert "pip install --upgrade 'torch>=2.6'" in message


def test_the_floor_compares_minor_numbers_not_text() -> None:
    with pytest.raises(ImportError):
        check_torch_version("2.9.0", minimum=(2, 10))
    check_torch_version("2.10.0", minimum=(2, 10))


def test_installed_torch_passes() -> None:
    check_torch_version()


def test_importing_accumlab_on_an_old_torch_fails_with_the_message() -> None:
    # A fake version string on the real torch: the check must run before any submodule.
    code = "import torch; torch.__version__ = '2.4.1'; import accumlab"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode != 0
    assert "ImportError: accumlab needs PyTorch >= 2.6 but found torch 2.4.1" in proc.stderr


def test_pyproject_declares_the_same_floor() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_deps = [d for d in project["dependencies"] if d.split(">")[0].strip() == "torch"]
    floor = ".".join(map(str, MIN_TORCH))
    assert torch_deps == [f"torch>={floor}"]
