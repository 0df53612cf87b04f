"""tools/learner_copies.py: the learner's notebooks live in a git-ignored folder.

A learner's run, answers and saves must never change a tracked file: ``sync`` copies the
lessons on first use and never overwrites, ``restore`` replaces a copy only when asked and
keeps the old one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import learner_copies as copies
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_running_jupyter(tmp_path_factory, monkeypatch):
    """restore asks running Jupyter servers which notebooks are open: none here, unless a
    test starts one."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path_factory.mktemp("runtime")))


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
    every = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [p.name for p in lessons] == [p.name for p in every]
    assert lessons[0].name == "00_start_here.ipynb"
    assert lessons[-1].name == "09_who_divides_by_what.ipynb"


def test_relative_links_resolve_from_the_copies_folder():
    # The notebooks open ../Makefile, ../examples/ddp_train.py and link ../accumlab/loop.py:
    # the copies sit at the same depth as notebooks/, so each resolves to the same file.
    assert (ROOT / copies.COPIES / ".." / "Makefile").resolve() == (ROOT / "Makefile")
    for lesson in copies.course_notebooks(ROOT):
        for target in ("../Makefile", "../examples/ddp_train.py", "../accumlab/loop.py"):
            if target in lesson.read_text(encoding="utf-8"):
                assert (ROOT / copies.COPIES / target).resolve().is_file(), (lesson.name, target)


# --- a backup never replaces an existing file --------------------------------------------


def test_two_restores_in_one_second_keep_both_backups(course):
    """Backup names carry the time to the second; a second restore within that second
    must take another name, not replace the first backup (the learner's answers)."""
    copies.sync(course)
    mine = course / "my-notebooks" / "03_amp_gradscaler.ipynb"
    mine.write_text('{"my": "answers"}')
    os.chmod(mine, 0o640)
    os.utime(mine, (1_000_000_000, 1_000_000_000))
    (first,) = copies.restore(["03"], root=course, now=0)
    kept = course / "my-notebooks" / "backups" / first.rsplit("/", 1)[1]
    assert kept.stat().st_mtime == 1_000_000_000 and kept.stat().st_mode & 0o777 == 0o640
    mine.write_text('{"my": "second answers"}')
    (second,) = copies.restore(["03"], root=course, now=0)
    backups = sorted((course / "my-notebooks" / "backups").iterdir())
    assert sorted(p.read_text() for p in backups) == ['{"my": "answers"}',
                                                      '{"my": "second answers"}']
    named = {line.rsplit("kept as my-notebooks/backups/", 1)[1] for line in (first, second)}
    assert named == {p.name for p in backups}  # each line names its own backup


def test_restore_of_one_lesson_named_twice_backs_it_up_once(course):
    copies.sync(course)
    mine = course / "my-notebooks" / "03_amp_gradscaler.ipynb"
    mine.write_text('{"my": "answers"}')
    lines = copies.restore(["03", "03_amp_gradscaler"], root=course, now=0)
    assert len(lines) == 1
    (backup,) = (course / "my-notebooks" / "backups").iterdir()
    assert backup.read_text() == '{"my": "answers"}'
    assert mine.read_text() == '{"lesson": "03_amp_gradscaler"}'


def test_a_backup_never_replaces_a_file_already_there(course):
    """Even a file the learner put at the name a backup would take is left alone."""
    copies.sync(course)
    (course / "my-notebooks" / "03_amp_gradscaler.ipynb").write_text('{"my": "answers"}')
    backups = course / "my-notebooks" / "backups"
    backups.mkdir()
    stamp = copies.time.strftime("%Y%m%d-%H%M%S", copies.time.localtime(0))
    taken = backups / f"03_amp_gradscaler.{stamp}.ipynb"
    taken.write_text("older backup")
    copies.restore(["03"], root=course, now=0)
    assert taken.read_text() == "older backup"
    assert sorted(p.read_text() for p in backups.iterdir()) == ["older backup", '{"my": "answers"}']


def test_concurrent_restores_lose_nothing(course):
    """Eight restores of one lesson at once, all in the same second: each takes its own
    backup name, every backup is a whole file, and the learner's answers are in at least one."""
    import threading

    copies.sync(course)
    mine = course / "my-notebooks" / "03_amp_gradscaler.ipynb"
    answers = '{"my": "answers", "pad": "' + "x" * 200_000 + '"}'
    mine.write_text(answers)
    start = threading.Barrier(8)
    errors = []

    def restore() -> None:
        start.wait()
        try:
            copies.restore(["03"], root=course, now=0)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=restore) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    kept = [p.read_text() for p in (course / "my-notebooks" / "backups").iterdir()]
    assert len(kept) == 8
    assert answers in kept  # all may hold it (each read it before any replaced it)
    assert all(text in (answers, '{"lesson": "03_amp_gradscaler"}') for text in kept)
    assert mine.read_text() == '{"lesson": "03_amp_gradscaler"}'


@pytest.mark.parametrize("blocked", ["my-notebooks", "my-notebooks/backups"])
@pytest.mark.parametrize("command", ["sync", "restore"])
def test_a_file_where_a_folder_goes_is_one_clear_line(course, blocked, command):
    """The command as `make lab`/`make restore NB=03` runs it, in a checkout whose
    my-notebooks (or its backups) is a file: one line naming it and the way out, exit 1."""
    if command == "sync" and blocked != "my-notebooks":
        pytest.skip("sync makes no backups")
    for part in ("tools/learner_copies.py", "accumlab/atomic_write.py"):  # as in a checkout
        (course / part).parent.mkdir(exist_ok=True)
        shutil.copy2(ROOT / part, course / part)
    if blocked != "my-notebooks":
        copies.sync(course)
    (course / blocked).write_text("a file, not a folder")
    run = subprocess.run([sys.executable, "tools/learner_copies.py", command,
                          *(["03"] if command == "restore" else [])],
                         cwd=course, capture_output=True, text=True, check=False)
    assert "Traceback" not in run.stderr and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.returncode == 1
    assert run.stderr.startswith(f"{blocked} is a file, not a folder; ")
    assert f"mv {blocked} {blocked}.old" in run.stderr
    assert (course / blocked).read_text() == "a file, not a folder"  # left alone
    if blocked != "my-notebooks":  # and so is the learner's copy
        assert (course / "my-notebooks" / "03_amp_gradscaler.ipynb").exists()


def _lesson_json(text: str) -> str:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("print(1)", outputs=[
        nbformat.v4.new_output("display_data", data={"text/html": f"<b>{text}</b>"})]))
    return nbformat.writes(nb)


def test_fresh_copies_are_marked_trusted_and_the_learners_are_left_alone(course, tmp_path,
                                                                         monkeypatch, capsys):
    nbformat = pytest.importorskip("nbformat")
    from nbformat.sign import NotebookNotary

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))  # a signature db of its own
    for name in ("00_start_here", "01_single_device_loop"):
        (course / "notebooks" / f"{name}.ipynb").write_text(_lesson_json(name))
    mine = course / "my-notebooks" / "01_single_device_loop.ipynb"
    mine.parent.mkdir()
    mine.write_text(_lesson_json("my answers"))  # the learner's: not copied, so not signed by us

    assert copies.main(["sync"], root=course) == 0
    line = capsys.readouterr().out
    assert "1 marked trusted" in line and "03_amp_gradscaler.ipynb" in line  # not JSON of a notebook

    def trusted(path: Path) -> bool:
        return NotebookNotary().check_signature(nbformat.read(path, as_version=4))

    assert trusted(course / "my-notebooks" / "00_start_here.ipynb")
    assert not trusted(mine)
    assert copies.main(["restore", "01"], root=course) == 0
    assert "1 marked trusted" in capsys.readouterr().out
    assert trusted(mine)  # the fresh copy of the lesson, not the learner's saved one


def test_a_failed_write_of_the_fresh_copy_leaves_the_learners_copy(course, monkeypatch, capsys):
    """The fresh copy goes through accumlab's one atomic writer: a full disk at the rename
    leaves the learner's copy as it was (and its backup made), no temporary file, and one
    line naming the copy and the cause."""
    copies.sync(course)
    mine = course / "my-notebooks" / "03_amp_gradscaler.ipynb"
    mine.write_text('{"my": "answers"}')

    def full_disk(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(copies.atomic_write.os, "replace", full_disk)
    assert copies.main(["restore", "03"], root=course) == 1
    assert mine.read_text() == '{"my": "answers"}'
    (backup,) = (course / "my-notebooks" / "backups").iterdir()
    assert backup.read_text() == '{"my": "answers"}'
    assert sorted(p.name for p in mine.parent.iterdir() if p.name.endswith(".tmp")) == []
    assert capsys.readouterr().err == f"restore: cannot write {mine}: No space left on device\n"


def test_the_tool_runs_without_torch(course):
    """`make restore` runs the tool with the system's Python, which may have no torch: the
    atomic writer it shares with accumlab is loaded by its path, not through the package."""
    probe = ("import runpy, sys; sys.modules['torch'] = None  # import torch fails\n"
             f"tool = runpy.run_path({str(ROOT / 'tools' / 'learner_copies.py')!r})\n"
             f"sys.exit(tool['main'](['restore', '03'], root=__import__('pathlib').Path({str(course)!r})))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("created my-notebooks/03_amp_gradscaler.ipynb")
    assert (course / "my-notebooks" / "03_amp_gradscaler.ipynb").read_text() == '{"lesson": "03_amp_gradscaler"}'


# --- a copy open in a running JupyterLab ------------------------------------------------


@pytest.fixture
def jupyter(tmp_path, monkeypatch):
    """A stand-in Jupyter server on 127.0.0.1 that lists its open notebooks
    (``/api/sessions``) to a request with its token, described in a runtime folder as
    Jupyter describes a running server; yields a function that sets the open paths."""
    import http.server
    import json
    import threading

    open_paths: list[str] = []

    class Sessions(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the handler's name)
            if self.path != "/api/sessions" or self.headers.get("Authorization") != "token secret":
                self.send_error(403)
                return
            body = json.dumps([{"path": p, "type": "notebook"} for p in open_paths]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sessions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))

    def serve(root: Path, *paths: str) -> str:
        open_paths[:] = paths
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        (runtime / f"jpserver-{os.getpid()}.json").write_text(json.dumps(
            {"url": url, "token": "secret", "root_dir": str(root), "pid": os.getpid()}))
        return url

    yield serve
    server.shutdown()


def test_restore_warns_when_the_copy_is_open_in_jupyterlab(course, jupyter):
    copies.sync(course)
    url = jupyter(course, "my-notebooks/03_amp_gradscaler.ipynb")
    warning, replaced = copies.restore(["03"], root=course, now=0)
    assert warning.startswith(f"warning: my-notebooks/03_amp_gradscaler.ipynb is open in "
                              f"JupyterLab ({url}): its tab still holds your old copy")
    assert "choose Revert" in warning and "Overwrite would put your old copy back" in warning
    assert replaced.startswith("replaced my-notebooks/03_amp_gradscaler.ipynb")  # restored anyway
    assert [line[:9] for line in copies.restore(["01"], root=course, now=0)] == ["replaced "]


def test_a_gone_or_silent_server_is_skipped(course, jupyter, tmp_path):
    import json
    import socket

    jupyter(course, "my-notebooks/03_amp_gradscaler.ipynb")
    runtime = Path(os.environ["JUPYTER_RUNTIME_DIR"])
    info = runtime / f"jpserver-{os.getpid()}.json"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = json.loads(info.read_text()) | {"pid": int(gone.stdout)}  # its process ended
    info.write_text(json.dumps(stale))
    assert copies.open_notebooks() == {}
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    info.write_text(json.dumps(stale | {"pid": os.getpid(), "url": f"http://127.0.0.1:{port}/"}))
    assert copies.open_notebooks() == {}
    info.write_text("not json")
    assert copies.open_notebooks() == {}
