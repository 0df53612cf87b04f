"""The package works as a user installs it: from a wheel, outside the repository.

One wheel is built from a copy of the working tree (so the build leaves nothing in the
repository), without build isolation (offline, and fast). It is installed with
``--no-deps`` into a fresh virtual environment that reaches this test environment's
packages (torch, matplotlib, ...) through a ``.pth`` line. A ``.pth`` line only appends a
directory to ``sys.path``; the ``.pth`` files inside that directory, among them the hook
of an editable install of accumlab, are not run, so the fresh environment imports the
wheel's copy (checked below). The commands then run from a temporary directory, away
from the repository's ``data/`` and sources.

Deselect with ``-m "not packaging"``.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import accumlab
from accumlab._torch_version import MIN_TORCH

pytestmark = [pytest.mark.packaging, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# Never copied into the build tree: environments, VCS data, caches and earlier outputs.
_NOT_SOURCES = shutil.ignore_patterns(
    ".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", "runs",
    ".hypothesis", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints",
)  # fmt: skip


@dataclass(frozen=True)
class Installed:
    wheel: Path
    build_log: str
    python: Path  # the fresh environment's interpreter
    scripts: Path  # its bin/ (Scripts\ on Windows)
    site_packages: Path
    workdir: Path  # a directory outside the repository to run commands from
    env: dict[str, str]


def _run(cmd: list[str | Path], **kwargs) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on failure, fail the test with its output."""
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, cmd))} exited with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    src, dist, venv = root / "src", root / "dist", root / "venv"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCES)

    # Byte-compilation off (PYTHONDONTWRITEBYTECODE) makes setuptools print a warning of
    # its own; the build is checked for warnings with the ordinary setting.
    build_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    build = _run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src],
        env=build_env,
    )
    (wheel,) = dist.glob("accumlab-*.whl")

    # The fresh environment sees nothing of this one's PYTHONPATH or venv settings.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TQDM_DISABLE="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], env=env)
    scripts = venv / ("Scripts" if os.name == "nt" else "bin")
    python = scripts / ("python.exe" if os.name == "nt" else "python")
    # This environment's pip installs into the fresh one (which has no pip of its own),
    # before the fresh one can see this environment's accumlab.
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
         "--no-index", "--disable-pip-version-check", "--quiet", wheel],
        env=env,
    )  # fmt: skip
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env
    ).stdout.strip()
    ours = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    ours += site.getsitepackages()
    lines = [p for p in dict.fromkeys(ours) if Path(p).is_dir()]
    Path(purelib, "_accumlab_test_env.pth").write_text("\n".join(lines) + "\n")

    workdir = root / "elsewhere"
    workdir.mkdir()
    env["PATH"] = os.pathsep.join([str(scripts), env.get("PATH", "")])
    return Installed(
        wheel, build.stdout + build.stderr, python, scripts, Path(purelib), workdir, env
    )


def test_build_has_no_warnings(installed: Installed) -> None:
    warnings = [line for line in installed.build_log.splitlines() if "warning" in line.lower()]
    assert warnings == []


def test_wheel_holds_every_module_the_data_and_nothing_else(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(f"accumlab-{accumlab.__version__}.dist-info/METADATA").decode()
    modules = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "accumlab").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert "accumlab/course/exercises/__init__.py" in modules  # the walk saw subpackages
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert {"accumlab/py.typed", "accumlab/course/instructions.jsonl"} <= names
    assert {n.split("/")[0] for n in names} == {
        "accumlab",
        f"accumlab-{accumlab.__version__}.dist-info",
    }
    floor = ".".join(map(str, MIN_TORCH))
    assert f"Requires-Dist: torch>={floor}" in metadata.splitlines()


def test_fresh_environment_imports_the_wheel(installed: Installed) -> None:
    code = (
        "import accumlab, accumlab.course.data as d; print(accumlab.__file__); print(d.DATA_PATH)"
    )
    out = _run([installed.python, "-c", code], cwd=installed.workdir, env=installed.env)
    module_file, data_file = (Path(line).resolve() for line in out.stdout.splitlines())
    site_packages = installed.site_packages.resolve()
    assert module_file.is_relative_to(site_packages)
    assert data_file == site_packages / "accumlab" / "course" / "instructions.jsonl"


def test_accumlab_env_runs(installed: Installed) -> None:
    out = _run([installed.scripts / "accumlab", "env"], cwd=installed.workdir, env=installed.env)
    assert "torch" in out.stdout


def test_one_update_trains_and_writes_its_record(installed: Installed) -> None:
    record_path = installed.workdir / "run.json"
    _run(
        [installed.scripts / "accumlab", "train", "--updates", "1", "--quiet",
         "--record", record_path],
        cwd=installed.workdir,
        env=installed.env,
    )  # fmt: skip
    record = json.loads(record_path.read_text())
    assert record["updates_applied"] == 1
    assert record["examples"] == record["effective_batch_size"]
    assert record["targets"] > 0


def test_version_matches_the_wheel(installed: Installed) -> None:
    code = "import accumlab as al; print(al.__version__)"
    out = _run([installed.python, "-c", code], cwd=installed.workdir, env=installed.env)
    assert out.stdout.strip() == accumlab.__version__
    assert installed.wheel.name.startswith(f"accumlab-{out.stdout.strip()}-")
