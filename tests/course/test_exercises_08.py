"""The notebook-08 exercise: predict the factor a Trainer scales GPT-2's gradient by.

The expected counts are checked against the notebook's own window (the same 8 examples,
collated the same way), so a change of data or collate cannot leave the answer stale.
"""

from __future__ import annotations

import pytest
import torch

from accumlab.course.data import collate, load_examples
from accumlab.course.exercises import NOT_ATTEMPTED, ex08


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

    assert_unsolved(
        "08_audit_your_job.ipynb", {"factor_predicted": "ex08", "first_label_masked": "ex08"}
    )


# ------------------------------------------------------- first_label_masked (transfer)

pytest.importorskip("transformers")  # the checker audits a real Trainer job


def with_where(batch):
    labels = batch["labels"]
    first = torch.zeros_like(labels, dtype=torch.bool)
    first[:, 0] = True
    return {**batch, "labels": torch.where(first, torch.full_like(labels, -100), labels)}


def in_place(batch):
    batch["labels"][:, 0] = -100
    return batch


def row_by_row(batch):
    out = {k: v for k, v in batch.items()}
    labels = out["labels"].clone()
    for row in labels:
        row[0] = -100
    out["labels"] = labels
    return out


@pytest.mark.parametrize(
    "answer",
    [ex08.reference_first_label_masked, with_where, in_place, row_by_row],
    ids=lambda f: f.__name__,
)
def test_correct_collators_in_other_styles_pass(answer, capsys):
    assert ex08.first_label_masked.check(answer) is True
    assert "✓ first_label_masked: correct" in capsys.readouterr().out


def identity(batch):
    return batch


def shifted(batch):
    labels = torch.full_like(batch["labels"], -100)
    labels[:, :-1] = batch["labels"][:, 1:]
    return {**batch, "labels": labels}


def last_label(batch):
    labels = batch["labels"].clone()
    labels[:, -1] = -100
    return {**batch, "labels": labels}


def first_input(batch):
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    ids[:, 0], labels[:, 0] = 0, -100
    return {**batch, "input_ids": ids, "labels": labels}


def no_mask(batch):
    labels = batch["labels"].clone()
    labels[:, 0] = -100
    return {"input_ids": batch["input_ids"], "labels": labels}


def labels_only(batch):
    labels = batch["labels"].clone()
    labels[:, 0] = -100
    return labels


def stub(batch):
    raise NotImplementedError


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (identity, "row 0 still has a label at position 0"),
        (shifted, "do not shift the labels"),
        (last_label, "labels after position 0 changed"),
        (first_input, "input_ids changed"),
        (no_mask, "keep the batch's entries"),
        (labels_only, "return the batch (a dict with labels), got Tensor"),
        (42, "expected a function, got int"),
    ],
    ids=["identity", "shifted", "last_label", "first_input", "no_mask", "labels_only", "int"],
)
def test_wrong_collators_are_named(answer, named, capsys):
    assert ex08.first_label_masked.check(answer) is False
    out = capsys.readouterr().out
    assert "✗" in out and named in out, out


def test_the_stub_is_not_attempted(capsys):
    assert ex08.first_label_masked.check(stub) is False
    assert NOT_ATTEMPTED in capsys.readouterr().out


def test_the_audit_half_of_the_checker_sees_the_wrong_count():
    """Without the batch checks, the Trainer job collating through an answer that leaves
    position 0 labelled fails the audit (and the reference passes it)."""
    from accumlab.course.exercises.ex08 import _audit_with

    assert "count_before_shift" in _audit_with(identity)
    assert _audit_with(ex08.reference_first_label_masked) is None
