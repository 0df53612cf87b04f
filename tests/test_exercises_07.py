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

    assert_unsolved("07_capstone.ipynb", {
        "clinic_window": "ex07", "diagnose": "ex07", "updates_predicted": "ex07",
        "ratio_predicted": "ex07", "rate_predicted": "ex07"})


# ------------------------------------------------------------ diagnose (transfer)

def _exact_diagnose(weights, targets, positions):
    # The reference's order, but with == instead of a tolerance.
    a, total = len(weights), sum(targets)
    if 0.0 in weights:
        return "missing_contributions"
    if all(w == 1.0 for w in weights):
        return "ok"
    if all(w == 1 / a for w in weights):
        return "double_division"
    if all(w == total / (a * t) for w, t in zip(weights, targets, strict=True)):
        return "average_of_averages"
    if all(w == total / sum(positions) for w in weights):
        return "ignored_tokens_counted"
    return "unknown"


def _loop_first(weights, targets, positions):
    # Looks for the average of averages before "ok": names a loop, not a fingerprint.
    a, total = len(weights), sum(targets)
    if all(abs(w - total / (a * t)) < 1e-4 for w, t in zip(weights, targets, strict=True)):
        return "average_of_averages"
    return ex07.reference_diagnose(weights, targets, positions)


def _constant_means_double(weights, targets, positions):
    if all(abs(w - weights[0]) < 1e-4 for w in weights) and weights[0] < 0.999 and weights[0] > 0:
        return "double_division"
    return ex07.reference_diagnose(weights, targets, positions)


def test_diagnose_reference_passes(capsys):
    assert ex07.diagnose.check(ex07.reference_diagnose) is True
    assert "✅ diagnose: correct" in capsys.readouterr().out


def test_diagnose_names_an_exact_comparison(capsys):
    assert ex07.diagnose.check(_exact_diagnose) is False
    assert "compare with a tolerance" in capsys.readouterr().out


def test_diagnose_names_equal_counts_trap(capsys):
    assert ex07.diagnose.check(_loop_first) is False
    out = capsys.readouterr().out
    assert "the same number of targets" in out and "weighs every target right" in out


def test_diagnose_names_a_constant_that_is_not_one_over_a(capsys):
    assert ex07.diagnose.check(_constant_means_double) is False
    assert "a constant weight below 1 is 1/A only if" in capsys.readouterr().out


def test_diagnose_wrong_return_and_stub(capsys):
    assert ex07.diagnose.check(lambda w, t, p: "bad loop") is False
    assert "return one of 'ok', 'double_division'" in capsys.readouterr().out
    assert ex07.diagnose.check(lambda w, t, p: "ok") is False
    assert "the fingerprint is 'double_division'" in capsys.readouterr().out
    assert ex07.diagnose.check(...) is False
    assert NOT_ATTEMPTED in capsys.readouterr().out


def test_every_diagnose_case_is_what_the_reference_says():
    for kind, targets, positions, expected in ex07.DIAGNOSE_CASES:
        assert ex07.reference_diagnose(ex07._case(kind, targets, positions), targets, positions) == expected


# ------------------------------------------------------------ predict first

def test_predictions_pass_name_and_wait(capsys):
    for exercise, right, wrong, says in [
        (ex07.updates_predicted, 32, 64, "loader batches"),
        (ex07.ratio_predicted, 0.25, 4, "the inverse"),
        (ex07.rate_predicted, 0.0625, 0.025, "per-update schedule"),
    ]:
        assert exercise.check(right) is True
        assert exercise.check(wrong) is False
        assert says in capsys.readouterr().out
        assert exercise.check(...) is False
        assert NOT_ATTEMPTED in capsys.readouterr().out
