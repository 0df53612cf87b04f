"""The course's two times (the core path, everything) come from the notebooks by one formula
(tools/course_time.py), the core path fits a half day, and every document that states the
times states these.

The formula's unit test counts a small notebook by hand, apart from the tool: 130 prose
words are a minute, 20 code lines a minute, 40 output lines a minute, an exercise 15 and
a prediction 2 (a newcomer's pace).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CORE_LIMIT_MINUTES = 240  # a half day: the core path must fit in 4 hours


@pytest.fixture(scope="module")
def tool():
    return importlib.import_module("course_time")


def _md(text: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def _code(text: str, **extra) -> dict:
    return {"cell_type": "code", "metadata": {}, "source": text, "outputs": [], "execution_count": 1, **extra}


def _words(n: int) -> str:
    return " ".join(["word"] * n)


def _lines(n: int) -> str:
    return "\n".join(f"x{i} = {i}" for i in range(n))


def test_the_formula_on_a_notebook_counted_by_hand(tool, tmp_path):
    cells = [
        _code("print('install')\n" * 40, id="accumlab-install"),  # never counted
        _md("# Title\n" + _words(179)),  # 180 words with the title (its # is not a word)
        _code(_lines(25) + "\n\n\n", outputs=[  # blank lines are not code
            {"output_type": "stream", "name": "stdout", "text": ["a\n", "\n", "b\n"]},  # 2 lines
            {"output_type": "display_data", "metadata": {},
             "data": {"text/plain": ["<Figure size 640x480 with 1 Axes>"], "image/png": "iVBOR"}},  # 1
            {"output_type": "execute_result", "execution_count": 1, "metadata": {},
             "data": {"text/plain": "x\ny\nz", "text/html": "<p>x</p>"}},  # 3
        ]),
        _md("## 1. Core\n" + _words(178)),
        _code("ex00.accumulation_steps.check(a)\nex00.accumulation_steps.check(b)"),  # one exercise
        _code("ex00.update_attempts.check(p)"),  # a prediction
        _md("## Deep dive: the details\n" + _words(356)),  # 360 words outside the core
        _md("### still inside\n" + _words(178)),
        _code(_lines(48) + "\nex00.replicas.check(r)", outputs=[
            {"output_type": "stream", "name": "stderr", "text": "w1\nw2\nw3\nw4\n"}]),  # 4 lines
        _md("## 2. Back in the core\n"),  # 5 words
        _code(_lines(24)),
    ]
    path = tmp_path / "00_start_here.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    nb = tool.measure(path)
    # core: 180 + 180 + 5 words = 365; 25 + 2 + 1 + 24 = 52 lines; 1 exercise, 1 prediction
    assert nb.core.words == 180 + 180 + 5
    assert nb.core.code_lines == 25 + 2 + 1 + 24
    assert nb.core.exercises == {"ex00.accumulation_steps"}
    assert nb.core.predictions == {"ex00.update_attempts"}
    assert nb.core.output_lines == 2 + 1 + 3
    assert nb.core.minutes == pytest.approx(365 / 130 + 52 / 20 + 6 / 40 + 15 + 2)
    # everything adds the deep dive: 360 + 180 words, 49 lines, one more exercise
    assert nb.everything.words == 365 + 360 + 180
    assert nb.everything.code_lines == 52 + 49
    assert nb.everything.exercises == {"ex00.accumulation_steps", "ex00.replicas"}
    assert nb.everything.output_lines == 6 + 4
    assert nb.everything.minutes == pytest.approx(905 / 130 + 101 / 20 + 10 / 40 + 30 + 2)


def test_a_lesson_marked_outside_the_core_counts_in_everything_only(tool, tmp_path):
    # notebook metadata {"accumlab": {"outside_core": true}}: an optional lesson, read whole
    cells = [
        _md("# Title\n" + _words(129)),  # 130 words
        _code(_lines(20) + "\nex00.accumulation_steps.check(a)", outputs=[
            {"output_type": "stream", "name": "stdout", "text": "a\nb\n"}]),  # 21 lines, 2 out
        _code("ex00.update_attempts.check(p)"),  # a prediction
    ]
    path = tmp_path / "09_optional.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {"accumlab": {"outside_core": True}},
                                "nbformat": 4, "nbformat_minor": 5}))
    nb = tool.measure(path)
    assert nb.outside_core
    assert (nb.core.words, nb.core.code_lines, nb.core.output_lines) == (0, 0, 0)
    assert nb.core.exercises == nb.core.predictions == set() and nb.core.minutes == 0
    assert (nb.everything.words, nb.everything.code_lines, nb.everything.output_lines) == (130, 22, 2)
    assert nb.everything.minutes == pytest.approx(130 / 130 + 22 / 20 + 2 / 40 + 15 + 2)
    _, core, everything = tool.course_time([path])
    assert core.minutes == 0 and everything.minutes == nb.everything.minutes


def test_hours_rounds_to_five_minutes(tool):
    assert tool.hours(232.4) == "3 h 50 min"
    assert tool.hours(242.6) == "4 h 05 min"
    assert tool.hours(41) == "40 min"
    assert tool.hours(600) == "10 h 00 min"


def test_a_check_of_something_that_is_not_an_exercise_is_refused(tool, tmp_path):
    path = tmp_path / "00_x.ipynb"
    path.write_text(json.dumps({"cells": [_code("ex00.describe.check(1)")], "metadata": {},
                                "nbformat": 4, "nbformat_minor": 5}))
    with pytest.raises(AttributeError):
        tool.measure(path)


def test_the_core_path_fits_a_half_day(tool):
    notebooks, core, _ = tool.course_time(NOTEBOOKS)
    assert core.minutes <= CORE_LIMIT_MINUTES, [(nb.name, round(nb.core.minutes)) for nb in notebooks]


def test_every_notebook_has_a_core_exercise_or_prediction(tool):
    for nb in tool.course_time(NOTEBOOKS)[0]:
        if nb.outside_core:  # an optional lesson: its exercises count in "everything"
            assert nb.everything.exercises or nb.everything.predictions, nb.name
            continue
        assert nb.core.exercises or nb.core.predictions, nb.name


@pytest.mark.parametrize("document", ["README.md", "docs/WORKSHOP.md"])
def test_the_documents_state_the_measured_times(tool, document):
    _, core, everything = tool.course_time(NOTEBOOKS)
    text = (REPO / document).read_text(encoding="utf-8")
    assert f"{tool.hours(core.minutes)} for the core path" in text, (document, tool.hours(core.minutes))
    assert f"{tool.hours(everything.minutes)} for everything" in text, (
        document, tool.hours(everything.minutes))
