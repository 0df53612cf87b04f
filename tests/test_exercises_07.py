"""The notebook-07 exercise: the reference passes the audit; wrong loops fail with names."""

from __future__ import annotations

import torch.nn.functional as F

from accumlab.course.exercises import NOT_ATTEMPTED, ex07


def _mean_loss(model, mb):
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), mb["labels"][:, 1:].reshape(-1)
    )


def average_of_averages(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    for mb in window:
        (_mean_loss(model, mb) / len(window)).backward()
    optimizer.step()
    scheduler.step()


def everything_inside(model, optimizer, scheduler, window):
    for mb in window:
        optimizer.zero_grad()
        (_mean_loss(model, mb) / len(window)).backward()
        optimizer.step()
        scheduler.step()


def stub(model, optimizer, scheduler, window):
    raise NotImplementedError


def test_reference_passes(capsys):
    assert ex07.clinic_window.check(ex07.reference_train_one_window) is True
    assert "✅ clinic_window: correct" in capsys.readouterr().out


def test_average_of_averages_is_named_with_its_fix(capsys):
    assert ex07.clinic_window.check(average_of_averages) is False
    out = capsys.readouterr().out
    assert "❌" in out and "the audit found average_of_averages." in out
    assert "reduction='sum'" in out  # the fix is printed


def test_every_misplaced_call_is_named(capsys):
    assert ex07.clinic_window.check(everything_inside) is False
    out = capsys.readouterr().out
    assert "the audit found average_of_averages, step_per_microbatch, scheduler_per_microbatch" in out


def test_stub_is_not_attempted(capsys):
    assert ex07.clinic_window.check(stub) is False
    out = capsys.readouterr().out
    assert NOT_ATTEMPTED in out and "ex07.clinic_window.hint()" in out


def test_not_a_function(capsys):
    assert ex07.clinic_window.check(42) is False
    assert "expected a function, got int" in capsys.readouterr().out


def test_notebook_ships_the_exercise_unsolved():
    from notebook_exercises import assert_unsolved

    assert_unsolved("07_capstone.ipynb", {"clinic_window": "ex07"})
