"""A prediction's answer, revealed folded: ``Exercise.reveal`` checks the value the cell
computed against the prediction's answer and shows it only inside a closed ``<details>``."""

from __future__ import annotations

import re

import pytest
from IPython.core.interactiveshell import InteractiveShell

from accumlab_course.exercises import Exercise
from accumlab_course.exercises.predictions import choice_prediction, number_prediction

NUMBER = number_prediction(__name__, "ratio", 2.25, what="the ratio", mistakes={1.0: "no change"},
                           hints=("think",), reasoning="because")
CHOICE = choice_prediction(__name__, "which", "the sum", choices=("the sum", "the mean"),
                           mistakes={}, hints=("think",), reasoning="because")


@pytest.fixture
def shown(monkeypatch):
    """What ``display`` was handed: one bundle per call."""
    bundles = []
    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: bundles.append(obj))
    InteractiveShell.clear_instance()
    return bundles


def test_the_answer_is_only_inside_a_closed_details_element(shown):
    NUMBER.reveal(2.2500001)
    (bundle,) = shown
    html, plain = bundle["text/html"], bundle["text/plain"]
    assert html.startswith('<details class="accumlab-answer"><summary>') and "<details open" not in html
    summary = re.search(r"<summary>(.*?)</summary>", html).group(1)
    assert "2.25" not in summary and "test_reveal.ratio" in summary
    body = html.split("</summary>", 1)[1]
    assert "<pre>2.25</pre>" in body
    assert "2.25" not in plain  # the plain text, a terminal's and a first line's view


def test_a_value_that_is_not_the_answer_fails_the_cell(shown):
    with pytest.raises(AssertionError, match=r"computed 1\.0, not the prediction's answer 2\.25"):
        NUMBER.reveal(1.0)
    assert shown == []


def test_a_choice_and_a_shown_text(shown):
    CHOICE.reveal("The  Sum", shown="the sum over the window's targets: 18 / 8")
    assert "<pre>the sum over the window&#x27;s targets: 18 / 8</pre>" in shown[0]["text/html"]


def test_an_exercise_is_not_revealed():
    code = Exercise("fn", lambda answer: None, ("h",), "solution")
    with pytest.raises(TypeError, match="only a prediction is revealed"):
        code.reveal(1)
