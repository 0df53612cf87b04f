"""The learner's own copies of the course notebooks, in a git-ignored folder.

``notebooks/`` holds the course as committed: the files CI tests and ``git pull`` updates.
A learner runs, edits and saves the copies in ``my-notebooks/`` instead (same depth in the
repository, so relative links such as ``../accumlab/loop.py`` still resolve), and their
answers never touch a tracked file, so a ``git pull`` that changes ``notebooks/`` cannot
conflict with them.

    python tools/learner_copies.py sync              # make lab: copy what is missing, never overwrite
    python tools/learner_copies.py restore 03        # a fresh copy of notebook 03 (yours kept as a backup)
    python tools/learner_copies.py restore all       # a fresh copy of every notebook

``restore`` never deletes a learner's work: the replaced copy is saved as
``my-notebooks/backups/<name>.<timestamp>.ipynb`` first (``...-2.ipynb``, ``-3``, ... when
a restore in the same second took that name: a backup never replaces a file), and the line
it prints says so. A copy that is open in a running JupyterLab gets a warning line as
well: its tab still holds the old notebook, and a save from it (JupyterLab asks "File
Changed": Overwrite) would put the old copy back over the fresh one; close the tab first,
or choose Revert. The running servers are found as Jupyter lists them (the
``jpserver-<pid>.json`` files of its runtime folder) and asked for their open notebooks
(``/api/sessions``, a notebook with a kernel); a server that does not answer within a
second is skipped.

The copies it makes are marked trusted in Jupyter's signature database, as if the learner
had run and saved them: the outputs they hold are the course's own, and JupyterLab shows an
untrusted notebook's saved widgets and rich outputs only after a re-run. That needs
``nbformat`` (``make lab`` runs this with the course's environment); without it the copies
are made all the same and the line printed says they are not marked. Otherwise standard
library only (accumlab's atomic writer, itself standard library only, is loaded by its
path): it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import stat
import sys
import time
import types
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

ROOT = Path(__file__).resolve().parents[1]


def _load_atomic_write() -> types.ModuleType:
    """``accumlab/atomic_write.py`` of this checkout, loaded by its path: importing the
    package would import torch, which the system's Python may not have."""
    spec = importlib.util.spec_from_file_location("_atomic_write", ROOT / "accumlab" / "atomic_write.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


atomic_write = _load_atomic_write()
COURSE = "notebooks"
COPIES = "my-notebooks"
BACKUPS = "backups"


class NotAFolderError(Exception):
    """Something other than a folder (a file, a broken link) is where a folder goes."""


def _make_folder(folder: Path, root: Path) -> None:
    """Create ``folder`` (one level) unless it is a folder already. Anything else in its
    place is left alone: :class:`NotAFolderError` names it and the way out."""
    try:
        folder.mkdir(exist_ok=True)
    except FileExistsError:
        shown = folder.relative_to(root).as_posix()
        kind = "a broken symlink" if folder.is_symlink() and not folder.exists() else "a file"
        raise NotAFolderError(
            f"{shown} is {kind}, not a folder; the learner's notebooks go in that folder, so "
            f"move it away (e.g. mv {shown} {shown}.old) and run the command again"
        ) from None


def course_notebooks(root: Path) -> list[Path]:
    """The lesson notebooks, in course order (``NN_name.ipynb``)."""
    return sorted((root / COURSE).glob("[0-9][0-9]_*.ipynb"))


def sync(root: Path = ROOT) -> list[Path]:
    """Copy every course notebook that has no copy yet into ``my-notebooks/``.

    Returns the copies made. An existing copy is never overwritten, whatever its age: it
    is the learner's. A lesson added to the course later is copied on the next call.
    """
    target = root / COPIES
    _make_folder(target, root)
    made = []
    for source in course_notebooks(root):
        copy = target / source.name
        if not copy.exists():
            shutil.copy2(source, copy)
            made.append(copy)
    return made


def _matching(root: Path, names: list[str]) -> list[Path]:
    lessons = course_notebooks(root)
    if names == ["all"]:
        return lessons
    chosen: list[Path] = []
    for name in names:
        found = [p for p in lessons if p.name.startswith(name) or p.stem == name]
        if len(found) != 1:
            known = ", ".join(p.stem for p in lessons)
            what = "matches no lesson" if not found else f"matches {len(found)} lessons"
            raise ValueError(f"restore: {name!r} {what}; give a number such as 03, a full "
                             f"name, or 'all' (lessons: {known})")
        if found[0] not in chosen:  # "03 03": one restore, not a backup of the fresh copy
            chosen.extend(found)
    return chosen


def _new_backup(backups: Path, stem: str, stamp: str) -> tuple[Path, BinaryIO]:
    """Create and open a new, empty backup file: ``<stem>.<stamp>.ipynb``, else the first
    free ``<stem>.<stamp>-N.ipynb`` (N = 2, 3, ...). Exclusive creation (``O_EXCL``): it is
    never a file that exists, even when another restore picks a name at the same moment."""
    for n in itertools.count(1):
        path = backups / f"{stem}.{stamp}{'' if n == 1 else f'-{n}'}.ipynb"
        try:
            return path, open(path, "xb")  # the caller closes it
        except FileExistsError:
            continue
    raise AssertionError("itertools.count never ends")


def _back_up(copy: Path, root: Path, stamp: str) -> tuple[Path, float] | None:
    """Copy the learner's ``copy`` into a new file in ``my-notebooks/backups/``, flushed
    to disk; return the backup and the copy's last-saved time (the backup keeps it), or
    ``None`` when there is no copy. The copy itself is left in place."""
    try:
        mine = open(copy, "rb")  # closed by the with below
    except FileNotFoundError:
        return None
    backups = root / COPIES / BACKUPS
    with mine:
        _make_folder(backups, root)
        saved = os.fstat(mine.fileno())
        kept, backup = _new_backup(backups, copy.stem, stamp)
        with backup:
            shutil.copyfileobj(mine, backup)
            backup.flush()
            os.fsync(backup.fileno())
    os.chmod(kept, stat.S_IMODE(saved.st_mode))  # the copy's permissions and times
    os.utime(kept, ns=(saved.st_atime_ns, saved.st_mtime_ns))
    return kept, saved.st_mtime


def _fresh_copy(source: Path, copy: Path) -> None:
    """Put a copy of ``source`` (its bytes, mode and times) at ``copy`` in one rename, so
    that a concurrent reader (another restore backing it up) sees the old file or the new
    one, never a mix: accumlab's one atomic writer (``accumlab/atomic_write.py``)."""
    with open(source, "rb") as lesson:
        atomic_write.write_atomically(copy, lambda out: shutil.copyfileobj(lesson, out))
    shutil.copystat(source, copy)


def jupyter_runtime_dir() -> Path:
    """Where running Jupyter servers describe themselves, as ``jupyter --runtime-dir``
    finds it: ``$JUPYTER_RUNTIME_DIR``, else ``runtime`` in Jupyter's data folder
    (``$JUPYTER_DATA_DIR``, else the platform's: ``~/Library/Jupyter`` on macOS,
    ``%APPDATA%/jupyter`` on Windows, ``$XDG_DATA_HOME/jupyter`` or
    ``~/.local/share/jupyter`` elsewhere)."""
    if os.environ.get("JUPYTER_RUNTIME_DIR"):
        return Path(os.environ["JUPYTER_RUNTIME_DIR"])
    if os.environ.get("JUPYTER_DATA_DIR"):
        return Path(os.environ["JUPYTER_DATA_DIR"]) / "runtime"
    home = Path.home()
    if sys.platform == "darwin":
        data = home / "Library" / "Jupyter"
    elif os.name == "nt":
        data = Path(os.environ.get("APPDATA", home)) / "jupyter"
    else:
        data = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share") / "jupyter"
    return data / "runtime"


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # alive but another user's, or a platform without it
        return True
    return True


def open_notebooks(runtime: Path | None = None, timeout: float = 1.0) -> dict[Path, str]:
    """The notebooks a running Jupyter server has open (with a kernel): ``{absolute path:
    the server's URL}``. Reads each ``jpserver-<pid>.json`` of ``runtime`` (default
    :func:`jupyter_runtime_dir`) whose process is alive and asks that server's
    ``/api/sessions`` with its token; a file it cannot read or a server that does not
    answer within ``timeout`` seconds is skipped (this is a courtesy warning, never a
    reason to fail)."""
    found: dict[Path, str] = {}
    folder = runtime if runtime is not None else jupyter_runtime_dir()
    for info_file in sorted(folder.glob("jpserver-*.json")) if folder.is_dir() else []:
        try:
            info = json.loads(info_file.read_text(encoding="utf-8"))
            url, root = str(info["url"]), Path(info["root_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(info.get("pid")):
            continue
        request = urllib.request.Request(url.rstrip("/") + "/api/sessions")
        if info.get("token"):
            request.add_header("Authorization", f"token {info['token']}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (a local server)
                sessions = json.loads(response.read().decode("utf-8"))
        except (OSError, ValueError):
            continue
        for session in sessions if isinstance(sessions, list) else []:
            path = session.get("path") if isinstance(session, dict) else None
            if isinstance(path, str) and path.endswith(".ipynb"):
                found[(root / path).resolve()] = url
    return found


def restore(names: list[str], root: Path = ROOT, now: float | None = None,
            report: Callable[[str], object] | None = None) -> list[str]:
    """Replace the learner's copies of ``names`` (``["03"]``, ``["all"]``) with fresh ones.

    The replaced copy is saved in ``my-notebooks/backups/`` first, under a name no file
    has (see :func:`_new_backup`); a lesson named twice is restored once. Returns one line
    per notebook saying what was replaced and where the old copy went; ``report`` gets
    each line as soon as it is true (so a failure later does not hide a backup made).
    """
    if not names:
        raise ValueError("restore: name a lesson (03, 03_amp_gradscaler) or 'all'")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    lessons = _matching(root, names)
    target = root / COPIES
    _make_folder(target, root)
    lines = []
    opened = open_notebooks()
    for source in lessons:
        copy = target / source.name
        if copy.resolve() in opened:
            lines.append(
                f"warning: {COPIES}/{source.name} is open in JupyterLab "
                f"({opened[copy.resolve()]}): its tab still holds your old copy. Close that "
                "tab without saving; if JupyterLab says \"File Changed\", choose Revert "
                "(Overwrite would put your old copy back over the fresh one)"
            )
            if report is not None:
                report(lines[-1])
        backed_up = _back_up(copy, root, stamp)
        _fresh_copy(source, copy)
        if backed_up is not None:
            kept, mtime = backed_up
            saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime))
            lines.append(f"replaced {COPIES}/{source.name} (your copy, last saved {saved}) "
                         f"with a fresh copy of {COURSE}/{source.name}; yours is kept as "
                         f"{COPIES}/{BACKUPS}/{kept.name}")
        else:
            lines.append(f"created {COPIES}/{source.name} from {COURSE}/{source.name} "
                         "(there was no copy to replace)")
        if report is not None:
            report(lines[-1])
    return lines


def trust(notebooks: list[Path]) -> list[Path] | None:
    """Sign ``notebooks`` in Jupyter's signature database (the one JupyterLab reads, under
    ``JUPYTER_DATA_DIR``). Returns the ones it could not read as notebooks (left unsigned),
    or None when ``nbformat`` is not installed (none signed)."""
    try:
        import nbformat
        from nbformat.sign import NotebookNotary
    except ImportError:
        return None
    notary, unread = NotebookNotary(), []
    for path in notebooks:
        try:
            notary.sign(nbformat.read(path, as_version=4))
        except (OSError, ValueError, KeyError, nbformat.ValidationError):
            unread.append(path)
    return unread


def _trusted(notebooks: list[Path]) -> str:
    """The end of the line printed for fresh copies: whether they were marked trusted."""
    if not notebooks:
        return ""
    unread = trust(notebooks)
    if unread is None:
        return "; not marked trusted (nbformat is not installed: `make lab` marks them)"
    note = f"; {len(notebooks) - len(unread)} marked trusted (their saved outputs show before a run)"
    if unread:
        note += "; not marked, not readable as notebooks: " + ", ".join(p.name for p in unread)
    return note


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    """The command line; ``root`` is the repository (this checkout unless a test says)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sync", help="copy the lessons that have no copy yet; never overwrite")
    rest = sub.add_parser("restore", help="a fresh copy of some lessons (yours kept as a backup)")
    rest.add_argument("names", nargs="*", help="lesson numbers or names, or 'all'")
    args = parser.parse_args(argv)
    try:
        if args.command == "restore":
            restore(args.names, root=root, report=print)
            fresh = [root / COPIES / p.name for p in _matching(root, args.names)]
            note = _trusted(fresh)
            if note:
                print(f"restore: {len(fresh)} fresh cop{'y' if len(fresh) == 1 else 'ies'}{note}")
            return 0
        made = sync(root)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    except NotAFolderError as error:
        print(error, file=sys.stderr)
        return 1
    except OSError as error:  # a permission, a full disk: one line, not a traceback
        where = f" ({error.filename})" if error.filename else ""
        print(f"{args.command}: {error.strerror or error}{where}", file=sys.stderr)
        return 1
    kept = len(course_notebooks(root)) - len(made)
    print(f"your notebooks are in {COPIES}/ (git-ignored: your answers stay yours): "
          f"{len(made)} copied from {COURSE}/, {kept} already there and left as they are"
          + ("" if not kept else "; `make restore NB=03` gives a fresh copy of one")
          + _trusted(made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
