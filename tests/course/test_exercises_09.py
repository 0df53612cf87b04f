"""The notebook-09 predictions: what a framework divides each target by, on the notebook's
own window.

The expected values are written here from the notebook's data and the frameworks' rules,
apart from ``ex09``'s constants: the first window is the first 8 short examples with every
real token labelled, ``A = 4``; Accelerate divides whatever loss it is given by ``A``, and
the ``Trainer`` divides a loss it passes no count to by the microbatches of the window.
"""

from __future__ import annotations

import pytest

from accumlab_course.data import collate, load_examples
from accumlab_course.exercises import NOT_ATTEMPTED, ex09


def _window_targets() -> int:
    examples = [ex for ex in load_examples() if len(ex.input_ids) <= 16][:8]
    labels = collate(examples, mask_prompt=False)["labels"]
    return int((labels[:, 1:] != -100).sum())


def test_the_constants_are_the_notebook_window():
    assert ex09.WINDOW_TARGETS == _window_targets()
    assert ex09.accelerate_divisor.answer == 4 * _window_targets()
    assert ex09.trainer_short_window.answer == 1


@pytest.mark.parametrize("answer", [4 * 95, 380.0, 95 * 4.0, 380.2])
def test_the_accelerate_divisor_in_any_form_passes(answer, capsys):
    assert ex09.accelerate_divisor.check(answer) is True
    assert "✓ accelerate_divisor: correct" in capsys.readouterr().out


@pytest.mark.parametrize("answer", [1, 1.0, 27 / 27])
def test_the_short_window_multiple_passes(answer, capsys):
    assert ex09.trainer_short_window.check(answer) is True
    assert "✓ trainer_short_window: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("prediction", "answer", "named"),
    [
        (ex09.accelerate_divisor, 95, "accelerator.backward divides what it is given"),
        (ex09.accelerate_divisor, 95 / 4, "a multiplication by A"),
        (ex09.accelerate_divisor, 103, "not 103"),
        (ex09.accelerate_divisor, "380", "write your prediction as a number"),
        (ex09.trainer_short_window, 4, "the configured A"),
        (ex09.trainer_short_window, 0.25, "the inverse"),
        (ex09.trainer_short_window, 2, "not 2"),
    ],
)
def test_wrong_predictions_are_named(prediction, answer, named, capsys):
    assert prediction.check(answer) is False
    assert named in capsys.readouterr().out


@pytest.mark.parametrize("prediction", [ex09.accelerate_divisor, ex09.trainer_short_window])
def test_a_stub_is_not_attempted(prediction, capsys):
    assert prediction.check(...) is False
    assert NOT_ATTEMPTED in capsys.readouterr().out
    assert prediction.kind == "prediction"
