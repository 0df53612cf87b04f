"""The library and the course work as a user installs them: from wheels, outside the repository.

Two wheels are built from a copy of the working tree (so the builds leave nothing in the
repository), without build isolation (offline, and fast): the library (``accumlab``, from
the root) and the course (``accumlab-course``, from ``course/``).

- **The library alone.** Its wheel goes with ``--no-deps`` into a fresh virtual environment
  that reaches only what the library declares it needs (PyTorch and tqdm, and what they
  need in turn) through a folder of links: matplotlib, ipywidgets and the course cannot be
  imported there, and the library still audits a loop.
- **The course.** Both wheels go into another fresh environment that reaches this test
  environment's packages through a ``.pth`` line. A ``.pth`` line only appends a directory
  to ``sys.path``; the ``.pth`` files inside that directory, among them the hooks of the
  editable installs, are not run, so the fresh environment imports the wheels' copies
  (checked below). The ``accumlab`` command trains from a directory away from the
  repository's ``data/`` and sources.

Deselect with ``-m "not packaging"``.
"""

from __future__ import annotations

import importlib.metadata as md
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
from packaging.requirements import Requirement

import accumlab
from accumlab._torch_version import MIN_TORCH

pytestmark = [pytest.mark.packaging, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# Never copied into the build tree: environments, VCS data, caches and earlier outputs.
_NOT_SOURCES = shutil.ignore_patterns(
    ".venv", ".venv-latest", ".git", "__pycache__", "*.egg-info", "build", "dist", "runs",
    ".hypothesis", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", "my-notebooks",
)  # fmt: skip


@dataclass(frozen=True)
class Installed:
    wheel: Path  # the library's
    course_wheel: Path
    build_log: str
    python: Path  # the course environment's interpreter
    scripts: Path  # its bin/ (Scripts\ on Windows)
    site_packages: Path
    workdir: Path  # a directory outside the repository to run commands from
    env: dict[str, str]
    alone: Path  # the interpreter of the environment with the library's wheel alone


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


def _venv(root: Path, env: dict[str, str], wheels: list[Path], reach: list[str]) -> tuple[Path, Path, Path]:
    """A fresh environment at ``root`` with ``wheels`` (no dependencies) that reaches the
    folders ``reach`` through a ``.pth`` line: its interpreter, scripts and site-packages."""
    _run([sys.executable, "-m", "venv", "--without-pip", root], env=env)
    scripts = root / ("Scripts" if os.name == "nt" else "bin")
    python = scripts / ("python.exe" if os.name == "nt" else "python")
    # This environment's pip installs into the fresh one (which has no pip of its own).
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
         "--no-index", "--disable-pip-version-check", "--quiet", *wheels],
        env=env,
    )  # fmt: skip
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env
    ).stdout.strip()
    Path(purelib, "_accumlab_test_env.pth").write_text("\n".join(reach) + "\n")
    return python, scripts, Path(purelib)


def declared_closure(names: list[str]) -> list[str]:
    """The installed distributions ``names`` need, and what those need, by their metadata."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen)


def linked_folder(folder: Path, distributions: list[str]) -> Path:
    """``folder`` holding a link to each top-level module and package the installed
    ``distributions`` own: a site-packages with those and nothing else."""
    folder.mkdir()
    for name in distributions:
        for file in md.distribution(name).files or []:
            top = file.parts[0]
            if top.endswith((".dist-info", ".pth")) or top in ("..", "__pycache__", "bin"):
                continue
            target = folder / top
            if not target.exists():
                target.symlink_to(Path(file.locate()).resolve().parents[len(file.parts) - 2]
                                  if len(file.parts) > 1 else Path(file.locate()).resolve())
    return folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    src, dist = root / "src", root / "dist"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCES)

    # Byte-compilation off (PYTHONDONTWRITEBYTECODE) makes setuptools print a warning of
    # its own; the build is checked for warnings with the ordinary setting.
    build_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    log = ""
    for project in (src, src / "course"):
        build = _run(
            [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, project],
            env=build_env,
        )
        log += build.stdout + build.stderr
    (wheel,) = dist.glob("accumlab-*.whl")
    (course_wheel,) = dist.glob("accumlab_course-*.whl")

    # The fresh environments see nothing of this one's PYTHONPATH or venv settings.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TQDM_DISABLE="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    ours = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    ours += site.getsitepackages()
    everything = [p for p in dict.fromkeys(ours) if Path(p).is_dir()]
    python, scripts, purelib = _venv(root / "venv", env, [wheel, course_wheel], everything)
    needs = [Requirement(r).name for r in md.requires("accumlab") or [] if "extra ==" not in r]
    only = linked_folder(root / "library-needs", declared_closure(needs))
    alone, _, _ = _venv(root / "alone", env, [wheel], [str(only)])

    workdir = root / "elsewhere"
    workdir.mkdir()
    env["PATH"] = os.pathsep.join([str(scripts), env.get("PATH", "")])
    return Installed(wheel, course_wheel, log, python, scripts, purelib, workdir, env, alone)


def test_build_has_no_warnings(installed: Installed) -> None:
    warnings = [line for line in installed.build_log.splitlines() if "warning" in line.lower()]
    assert warnings == []


def _modules(folder: Path) -> set[str]:
    return {p.relative_to(folder.parent).as_posix() for p in folder.rglob("*.py")
            if "__pycache__" not in p.parts}


def test_the_library_wheel_holds_the_library_and_nothing_of_the_course(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(f"accumlab-{accumlab.__version__}.dist-info/METADATA").decode()
    modules = _modules(REPO / "accumlab")
    assert "accumlab/loop_audit/run.py" in modules  # the walk saw subpackages
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert "accumlab/py.typed" in names
    assert {n.split("/")[0] for n in names} == {"accumlab", f"accumlab-{accumlab.__version__}.dist-info"}
    # no exercise, no solution, no data set, no course module
    assert not [n for n in names if "course" in n or "exercise" in n or n.endswith(".jsonl")]
    floor = ".".join(map(str, MIN_TORCH))
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    plain = sorted(r for r in requires if "extra ==" not in r)
    assert plain == [f"Requires-Dist: torch>={floor}", "Requires-Dist: tqdm"], plain
    assert "Entry-Point" not in metadata


def test_the_course_wheel_holds_the_course_the_data_and_the_command(installed: Installed) -> None:
    with zipfile.ZipFile(installed.course_wheel) as zf:
        names = set(zf.namelist())
        info = f"accumlab_course-{accumlab.__version__}.dist-info"
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        metadata = zf.read(f"{info}/METADATA").decode()
    modules = _modules(REPO / "course" / "accumlab_course")
    assert "accumlab_course/exercises/__init__.py" in modules
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert "accumlab_course/instructions.jsonl" in names
    assert {n.split("/")[0] for n in names} == {"accumlab_course", info}
    assert "accumlab = accumlab_course.cli:main" in entry_points
    assert f"Requires-Dist: accumlab=={accumlab.__version__}" in metadata.splitlines()


def test_the_library_alone_audits_a_loop_without_the_courses_packages(installed: Installed) -> None:
    """The library's wheel in an environment that has only what it declares: matplotlib,
    ipywidgets and the course are not importable, and a correct loop is audited ok (a
    wrong one named)."""
    code = """
import importlib.util, sys
import accumlab as al
import torch.nn.functional as F
missing = [m for m in ("matplotlib", "ipywidgets", "IPython", "accumlab_course", "transformers")
           if importlib.util.find_spec(m) is not None]
assert not missing, missing

def right(model, optimizer, scheduler, window):
    count = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
    optimizer.zero_grad()
    for mb in window:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                               ignore_index=-100, reduction="sum")
        (loss / count).backward()
    optimizer.step(); scheduler.step()

def twice(model, optimizer, scheduler, window):
    count = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
    optimizer.zero_grad()
    for mb in window:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                               ignore_index=-100, reduction="sum")
        (loss / count / len(window)).backward()
    optimizer.step(); scheduler.step()

print(al.__file__)
print(al.audit(right).ok, al.audit(twice).mistakes)
"""
    out = _run([installed.alone, "-c", code], cwd=installed.workdir, env=installed.env)
    module_file, verdicts = out.stdout.splitlines()
    assert "alone" in module_file and "site-packages" in module_file  # the wheel's copy
    assert verdicts == "True ['double_division']", out.stdout
    # the course, asked for, is one clear line naming what to install
    miss = subprocess.run([installed.alone, "-c", "import accumlab_course"], cwd=installed.workdir,
                          env=installed.env, capture_output=True, text=True)
    assert miss.returncode == 1 and "No module named 'accumlab_course'" in miss.stderr


def test_fresh_environment_imports_the_wheels(installed: Installed) -> None:
    code = (
        "import accumlab, accumlab_course.data as d; print(accumlab.__file__); print(d.DATA_PATH)"
    )
    out = _run([installed.python, "-c", code], cwd=installed.workdir, env=installed.env)
    module_file, data_file = (Path(line).resolve() for line in out.stdout.splitlines())
    site_packages = installed.site_packages.resolve()
    assert module_file.is_relative_to(site_packages)
    assert data_file == site_packages / "accumlab_course" / "instructions.jsonl"


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
