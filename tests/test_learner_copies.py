"""tools/learner_copies.py: the learner's notebooks live in a git-ignored folder.

A learner's run, answers and saves must never change a tracked file: ``sync`` copies the
lessons on first use and never overwrites, ``restore`` replaces a copy only when asked and
keeps the old one.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("learner_copies", ROOT / "tools" / "learner_copies.py")
copies = importlib.util.module_from_spec(spec)
spec.loader.exec_module(copies)


@pytest.fixture
def course(tmp_path: Path) -> Path:
    (tmp_path / "notebooks").mkdir()
    for name in ("00_start_here", "01_single_device_loop", "03_amp_gradscaler"):
        (tmp_path / "notebooks" / f"{name}.ipynb").write_text(f'{{"lesson": "{name}"}}')
    (tmp_path / "notebooks" / "scratch.ipynb").write_text("{}")  # not a lesson
    return tmp_path


def test_sync_copies_the_lessons_once_and_never_overwrites(course):
    made = copies.sync(course)
    assert [p.name for p in made] == ["00_start_here.ipynb", "01_single_device_loop.ipynb",
                                      "03_amp_gradscaler.ipynb"]
    mine = course / "my-notebooks" / "01_single_device_loop.ipynb"
    mine.write_text('{"my": "answers"}')
    (course / "notebooks" / "01_single_device_loop.ipynb").write_text('{"lesson": "v2"}')
    assert copies.sync(course) == []
    assert mine.read_text() == '{"my": "answers"}'  # a course update does not touch it
    # a lesson added to the course later is copied on the next sync
    (course / "notebooks" / "02_token_weighting.ipynb").write_text('{"lesson": "02"}')
    assert [p.name for p in copies.sync(course)] == ["02_token_weighting.ipynb"]


def test_restore_replaces_one_copy_and_keeps_the_old_one(course):
    copies.sync(course)
    mine = course / "my-notebooks" / "03_amp_gradscaler.ipynb"
    mine.write_text('{"my": "answers"}')
    (line,) = copies.restore(["03"], root=course, now=0)
    assert mine.read_text() == '{"lesson": "03_amp_gradscaler"}'
    (backup,) = (course / "my-notebooks" / "backups").iterdir()
    assert backup.read_text() == '{"my": "answers"}'
    assert line.startswith("replaced my-notebooks/03_amp_gradscaler.ipynb (your copy")
    assert f"kept as my-notebooks/backups/{backup.name}" in line
    assert (course / "my-notebooks" / "00_start_here.ipynb").read_text() == '{"lesson": "00_start_here"}'


def test_restore_all_and_missing_copies(course):
    lines = copies.restore(["all"], root=course)
    assert len(lines) == 3 and all(x.startswith("created my-notebooks/") for x in lines)
    assert len(copies.restore(["all"], root=course)) == 3
    assert len(list((course / "my-notebooks" / "backups").iterdir())) == 3


@pytest.mark.parametrize(("names", "says"), [(["09"], "matches no lesson"), ([], "name a lesson"),
                                              (["0"], "matches 3 lessons")])
def test_restore_refuses_an_unclear_name(course, names, says):
    with pytest.raises(ValueError, match=says):
        copies.restore(names, root=course)
    assert not (course / "my-notebooks" / "backups").exists()


def test_the_copies_folder_is_ignored_by_git_and_matches_every_lesson():
    ignored = subprocess.run(["git", "check-ignore", "-q", "my-notebooks/00_start_here.ipynb"],
                             cwd=ROOT, check=False).returncode
    assert ignored == 0
    lessons = copies.course_notebooks(ROOT)
    assert len(lessons) == 8 and lessons[0].name == "00_start_here.ipynb"


def test_relative_links_resolve_from_the_copies_folder():
    # The notebooks open ../Makefile, ../examples/ddp_train.py and link ../accumlab/loop.py:
    # the copies sit at the same depth as notebooks/, so each resolves to the same file.
    assert (ROOT / copies.COPIES / ".." / "Makefile").resolve() == (ROOT / "Makefile")
    for lesson in copies.course_notebooks(ROOT):
        for target in ("../Makefile", "../examples/ddp_train.py", "../accumlab/loop.py"):
            if target in lesson.read_text(encoding="utf-8"):
                assert (ROOT / copies.COPIES / target).resolve().is_file(), (lesson.name, target)
