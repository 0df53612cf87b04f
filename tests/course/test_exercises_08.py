"""The notebook-08 exercise: predict the factor a Trainer scales GPT-2's gradient by.

The expected counts are checked against the notebook's own window (the same 8 examples,
collated the same way), so a change of data or collate cannot leave the answer stale.
"""

from __future__ import annotations

import pytest

from accumlab_course.data import collate, load_examples
from accumlab_course.exercises import NOT_ATTEMPTED, ex08


def test_the_counts_are_the_notebook_windows():
    examples = [ex for ex in load_examples() if len(ex.input_ids) <= 16][:8]
    labels = collate(examples, mask_prompt=False)["labels"]
    assert int((labels != -100).sum()) == ex08.WINDOW_LABELS
    assert int((labels[:, 1:] != -100).sum()) == ex08.WINDOW_TARGETS


@pytest.mark.parametrize("answer", [95 / 103, 0.9223, 0.92233, 1 - 8 / 103])
def test_the_factor_in_any_form_passes(answer, capsys):
    assert ex08.factor_predicted.check(answer) is True
    assert "✓ factor_predicted: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (1, "count of the scored targets"),
        (103 / 95, "the inverse"),
        (0.25, "1/A"),
        (0.9, "not 0.9"),
        ("0.92", "write your prediction as a number"),
        (True, "write your prediction as a number"),
    ],
)
def test_wrong_answers_are_named(answer, named, capsys):
    assert ex08.factor_predicted.check(answer) is False
    out = capsys.readouterr().out
    assert "✗" in out and named in out


def test_stub_is_not_attempted_and_the_solution_gives_the_reasoning(capsys):
    assert ex08.factor_predicted.check(...) is False
    assert NOT_ATTEMPTED in capsys.readouterr().out
    ex08.factor_predicted.solution()
    out = capsys.readouterr().out
    assert "95 / 103" in out and "answer: 0.92233" in out


def test_notebook_ships_the_exercises_unsolved():
    from helpers.notebook_exercises import assert_unsolved

    assert_unsolved("08_audit_your_job.ipynb", {"factor_predicted": "ex08"})
