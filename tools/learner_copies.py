"""The learner's own copies of the course notebooks, in a git-ignored folder.

``notebooks/`` holds the course as committed: the files CI tests and ``git pull`` updates.
A learner runs, edits and saves the copies in ``my-notebooks/`` instead (same depth in the
repository, so relative links such as ``../accumlab/loop.py`` still resolve), and their
answers never touch a tracked file, so a ``git pull`` that changes ``notebooks/`` cannot
conflict with them.

    python tools/learner_copies.py sync              # make lab: copy what is missing, never overwrite
    python tools/learner_copies.py restore 03        # a fresh copy of notebook 03 (yours kept as a backup)
    python tools/learner_copies.py restore all       # a fresh copy of every notebook

``restore`` never deletes a learner's work: the replaced copy is moved to
``my-notebooks/backups/<name>.<timestamp>.ipynb`` first, and the line it prints says so.
Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COURSE = "notebooks"
COPIES = "my-notebooks"
BACKUPS = "backups"


def course_notebooks(root: Path) -> list[Path]:
    """The lesson notebooks, in course order (``NN_name.ipynb``)."""
    return sorted((root / COURSE).glob("[0-9][0-9]_*.ipynb"))


def sync(root: Path = ROOT) -> list[Path]:
    """Copy every course notebook that has no copy yet into ``my-notebooks/``.

    Returns the copies made. An existing copy is never overwritten, whatever its age: it
    is the learner's. A lesson added to the course later is copied on the next call.
    """
    target = root / COPIES
    target.mkdir(exist_ok=True)
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
    chosen = []
    for name in names:
        found = [p for p in lessons if p.name.startswith(name) or p.stem == name]
        if len(found) != 1:
            known = ", ".join(p.stem for p in lessons)
            what = "matches no lesson" if not found else f"matches {len(found)} lessons"
            raise ValueError(f"restore: {name!r} {what}; give a number such as 03, a full "
                             f"name, or 'all' (lessons: {known})")
        chosen.extend(found)
    return chosen


def restore(names: list[str], root: Path = ROOT, now: float | None = None) -> list[str]:
    """Replace the learner's copies of ``names`` (``["03"]``, ``["all"]``) with fresh ones.

    The replaced copy is moved to ``my-notebooks/backups/`` first. Returns one line per
    notebook saying what was replaced and where the old copy went.
    """
    if not names:
        raise ValueError("restore: name a lesson (03, 03_amp_gradscaler) or 'all'")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    target = root / COPIES
    target.mkdir(exist_ok=True)
    lines = []
    for source in _matching(root, names):
        copy = target / source.name
        if copy.exists():
            backups = target / BACKUPS
            backups.mkdir(exist_ok=True)
            kept = backups / f"{source.stem}.{stamp}.ipynb"
            copy.replace(kept)
            saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(kept.stat().st_mtime))
            lines.append(f"replaced {COPIES}/{source.name} (your copy, last saved {saved}) "
                         f"with a fresh copy of {COURSE}/{source.name}; yours is kept as "
                         f"{COPIES}/{BACKUPS}/{kept.name}")
        else:
            lines.append(f"created {COPIES}/{source.name} from {COURSE}/{source.name} "
                         "(there was no copy to replace)")
        shutil.copy2(source, copy)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sync", help="copy the lessons that have no copy yet; never overwrite")
    rest = sub.add_parser("restore", help="a fresh copy of some lessons (yours kept as a backup)")
    rest.add_argument("names", nargs="*", help="lesson numbers or names, or 'all'")
    args = parser.parse_args(argv)
    if args.command == "sync":
        made = sync()
        kept = len(course_notebooks(ROOT)) - len(made)
        print(f"your notebooks are in {COPIES}/ (git-ignored: your answers stay yours): "
              f"{len(made)} copied from {COURSE}/, {kept} already there and left as they are"
              + ("" if not kept else "; `make restore NB=03` gives a fresh copy of one"))
        return 0
    try:
        for line in restore(args.names):
            print(line)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
