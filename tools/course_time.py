"""How long the course takes a first-time learner, computed from the notebooks themselves.

The estimate is a formula over what a learner reads, types and answers, so the times that
README.md, docs/WORKSHOP.md and the site state can be checked against the notebooks
(``tests/notebooks/test_course_time.py``) and never drift:

    minutes = prose words / 130 + code lines / 20 + output lines / 40
              + 15 per exercise + 2 per prediction

(a newcomer's pace: 130 words of prose a minute, 20 lines of code and 40 lines of output
read a minute)

- **prose words**: whitespace-separated words of the markdown cells (a heading's ``#``
  marks are not words);
- **code lines**: non-blank lines of the code cells, except the install cell every notebook
  shares (``tools/install_cell.py``; a learner does not read it);
- **output lines**: non-blank lines of the saved outputs a learner reads: printed text
  (streams, errors) and each result's plain-text form (a figure or a widget counts as its
  one-line text form);
- **exercise**: an ``exNN.<name>`` with code to write, counted once per notebook however
  many cells call its ``check``; **prediction**: one whose ``kind`` is ``"prediction"``
  (a number or a choice written down before the cell that computes it).

The **core path** is every section except the deep dives: a heading that begins with
"Deep dive" starts one, and it runs to the next heading of the same or a higher level
that does not begin so (sub-headings inside it belong to it). Text before the first
heading belongs to the core. A lesson whose notebook metadata says
``{"accumlab": {"outside_core": true}}`` is optional as a whole: all of it counts in
"everything", none in the core path.

    .venv/bin/python tools/course_time.py notebooks/*.ipynb     # per notebook and in all
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

WORDS_PER_MINUTE = 130
CODE_LINES_PER_MINUTE = 20
OUTPUT_LINES_PER_MINUTE = 40
MINUTES_PER_EXERCISE = 15
MINUTES_PER_PREDICTION = 2
DEEP_DIVE = "Deep dive"
INSTALL_CELL_ID = "accumlab-install"
OUTSIDE_CORE = "outside_core"  # notebook metadata accumlab.outside_core: an optional lesson

_HEADING = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")
_CHECK = re.compile(r"\b(ex\d\d)\.(\w+)\.check\(")


@dataclass
class Counts:
    """What a learner reads, types and answers in one part of the course."""

    words: int = 0
    code_lines: int = 0
    output_lines: int = 0
    exercises: set[str] = field(default_factory=set)
    predictions: set[str] = field(default_factory=set)

    @property
    def minutes(self) -> float:
        return (
            self.words / WORDS_PER_MINUTE
            + self.code_lines / CODE_LINES_PER_MINUTE
            + self.output_lines / OUTPUT_LINES_PER_MINUTE
            + MINUTES_PER_EXERCISE * len(self.exercises)
            + MINUTES_PER_PREDICTION * len(self.predictions)
        )

    def add(self, other: Counts) -> None:
        self.words += other.words
        self.code_lines += other.code_lines
        self.output_lines += other.output_lines
        self.exercises |= other.exercises
        self.predictions |= other.predictions


@dataclass
class NotebookTime:
    """The core path and the whole of one notebook."""

    name: str
    core: Counts
    everything: Counts
    outside_core: bool = False


def _kind(module: str, name: str) -> str:
    """``"exercise"`` or ``"prediction"``: what ``accumlab_course.exercises.<module>.<name>`` is."""
    exercise = getattr(importlib.import_module(f"accumlab_course.exercises.{module}"), name)
    kind = getattr(exercise, "kind", None)
    if kind not in ("exercise", "prediction"):
        raise ValueError(f"{module}.{name} is not an exercise (kind {kind!r})")
    return kind


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def output_lines(cell: dict) -> int:
    """Non-blank lines of what a code cell's saved outputs show as text: streams and
    tracebacks, and each result's ``text/plain`` (a figure or widget counts as that line)."""
    lines = 0
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            text = output.get("text", "")
        elif output.get("output_type") == "error":
            text = "\n".join(output.get("traceback", []))
        else:
            text = output.get("data", {}).get("text/plain", "")
        text = "".join(text) if isinstance(text, list) else text
        lines += sum(1 for line in text.splitlines() if line.strip())
    return lines


def measure(path: Path) -> NotebookTime:
    """Count the core path and the whole of the notebook at ``path``."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    core, everything = Counts(), Counts()
    dive_level: int | None = None  # the heading level of the deep dive we are in, if any
    outside = bool(nb.get("metadata", {}).get("accumlab", {}).get(OUTSIDE_CORE))

    def here() -> list[Counts]:
        return [everything] if outside or dive_level is not None else [core, everything]

    for cell in nb["cells"]:
        text = _source(cell)
        if cell["cell_type"] == "markdown":
            fenced = False
            for line in text.splitlines():
                if line.lstrip().startswith("```"):
                    fenced = not fenced
                heading = None if fenced else _HEADING.match(line)
                if heading:
                    level, title = len(heading.group(1)), heading.group(2)
                    if title.startswith(DEEP_DIVE):
                        if dive_level is None or level <= dive_level:
                            dive_level = level
                    elif dive_level is not None and level <= dive_level:
                        dive_level = None
                words = len((heading.group(2) if heading else line).split())  # not the #s
                for counts in here():
                    counts.words += words
        elif cell["cell_type"] == "code":
            if cell.get("id") == INSTALL_CELL_ID:
                continue
            lines = sum(1 for line in text.splitlines() if line.strip())
            for module, name in _CHECK.findall(text):
                kind = _kind(module, name)
                for counts in here():
                    (counts.predictions if kind == "prediction" else counts.exercises).add(
                        f"{module}.{name}"
                    )
            shown = output_lines(cell)
            for counts in here():
                counts.code_lines += lines
                counts.output_lines += shown
    return NotebookTime(Path(path).stem, core, everything, outside)


def course_time(paths: list[Path]) -> tuple[list[NotebookTime], Counts, Counts]:
    """Each notebook's times, and the sums of the core paths and of everything."""
    notebooks = [measure(p) for p in sorted(paths)]
    core, everything = Counts(), Counts()
    for nb in notebooks:
        core.add(nb.core)
        everything.add(nb.everything)
    return notebooks, core, everything


def hours(minutes: float) -> str:
    """``minutes`` rounded to the nearest 5 minutes, as the docs write it: ``3 h 45 min``."""
    rounded = int(5 * round(minutes / 5))
    h, m = divmod(rounded, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    notebooks, core, everything = course_time(args.notebooks)
    print(f"{'notebook':<28} {'core':>7} {'all':>7}  core: words, code lines, output lines, exercises, predictions")
    for nb in notebooks:
        c = nb.core
        print(
            f"{nb.name:<28} {nb.core.minutes:>5.0f} m {nb.everything.minutes:>5.0f} m  "
            f"{c.words}, {c.code_lines}, {c.output_lines}, {len(c.exercises)}, {len(c.predictions)}"
        )
    print(f"core path: {hours(core.minutes)}; everything: {hours(everything.minutes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
