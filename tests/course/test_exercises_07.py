"""The notebook-07 exercise: the reference passes the audit; wrong loops fail with names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accumlab as al
from accumlab_course.exercises import NOT_ATTEMPTED, ex07


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
    assert ex07.fixed_window.check(ex07.reference_fixed_window) is True
    assert "✓ fixed_window: correct" in capsys.readouterr().out


def test_average_of_averages_is_named_with_its_fix(capsys):
    assert ex07.fixed_window.check(average_of_averages) is False
    out = capsys.readouterr().out
    assert "✗" in out and "the audit found average_of_averages." in out
    assert "reduction='sum'" in out  # the fix is printed


def test_every_misplaced_call_is_named(capsys):
    assert ex07.fixed_window.check(everything_inside) is False
    out = capsys.readouterr().out
    assert "the audit found average_of_averages, step_per_microbatch, scheduler_per_microbatch" in out


# ------------------------------------------------- right answers written apart from the reference
# Each from the exercise text alone, in another style than the reference.


def fixed_logits_loop(model, optimizer, scheduler, window):
    # Logits and a summed cross-entropy; clears after the step; a tensor running sum.
    total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
    if not total:
        return float("nan")
    running = None
    for mb in window:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        part = F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                               ignore_index=-100, reduction="sum")
        (part / total).backward()
        running = part.detach() if running is None else running + part.detach()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return float(running) / total


def fixed_review_style(model, optimizer, scheduler, window):
    # review_window's own style kept: the model's loss with num_items_in_batch, gradients
    # zeroed (not set to None) before the loop, None for a window without targets.
    total = sum((mb["labels"][:, 1:] != -100).sum() for mb in window)
    if int(total) == 0:
        return None
    optimizer.zero_grad(set_to_none=False)
    logged = torch.zeros((), dtype=torch.float64)
    for mb in window:
        loss = model(**mb, num_items_in_batch=int(total)).loss
        loss.backward()
        logged += loss.detach()
    optimizer.step()
    scheduler.step()
    return logged.item()


def fixed_row_by_row(model, optimizer, scheduler, window):
    # One forward pass per example, padding trimmed; the loss read back in float64.
    rows = [(mb["input_ids"][r], mb["attention_mask"][r], mb["labels"][r])
            for mb in window for r in range(mb["input_ids"].shape[0])]
    total = sum(int((labels[1:] != -100).sum()) for _, _, labels in rows)
    if total == 0:
        return float("nan")
    optimizer.zero_grad(set_to_none=True)
    logged = 0.0
    for ids, mask, labels in rows:
        n = int(mask.sum())
        logits = model(input_ids=ids[None, :n], attention_mask=mask[None, :n]).logits[0]
        part = F.cross_entropy(logits[:-1], labels[1:n], ignore_index=-100, reduction="sum")
        (part / total).backward()
        logged += float(part.detach().double())  # one host read per example: fine on CPU
    optimizer.step()
    scheduler.step()
    return logged / total


def test_fixed_window_accepts_answers_written_apart(capsys):
    for answer in (fixed_logits_loop, fixed_review_style, fixed_row_by_row):
        assert ex07.fixed_window.check(answer) is True, capsys.readouterr().out


def _good_window_of_the_notebook(model, optimizer, scheduler, window):
    # A good window without the skip (what the clinic once showed above the exercise): right
    # on windows with targets,
    # nan weights on a window without any.
    optimizer.zero_grad(set_to_none=True)
    total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
    logged = torch.zeros(())
    for mb in window:
        part = F.cross_entropy(
            model(input_ids=mb["input_ids"]).logits[:, :-1].flatten(0, 1),
            mb["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum")
        (part / total).backward()
        logged += part.detach()
    optimizer.step()
    scheduler.step()
    return float(logged) / total


def _hf_style_window(model, optimizer, scheduler, window):
    optimizer.zero_grad(set_to_none=True)
    total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
    for mb in window:
        model(**mb, num_items_in_batch=total).loss.backward()
    optimizer.step()
    scheduler.step()


def _no_skip(model, optimizer, scheduler, window):
    # Divides by the count without looking at it: 0 / 0 on a window without targets.
    optimizer.zero_grad(set_to_none=True)
    total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
    logged = torch.zeros(())
    for mb in window:
        loss = model(**mb, num_items_in_batch=torch.tensor(float(total))).loss
        loss.backward()
        logged += loss.detach()
    optimizer.step()
    scheduler.step()
    return float(logged)


def _returns_tensor(model, optimizer, scheduler, window):
    out = fixed_logits_loop(model, optimizer, scheduler, window)
    return torch.tensor(out)


def test_fixed_window_names_the_cells_above_and_the_log(capsys):
    assert ex07.fixed_window.check(_hf_style_window) is False
    assert "keep review_window's progress log" in capsys.readouterr().out
    assert ex07.fixed_window.check(_good_window_of_the_notebook) is False
    out = capsys.readouterr().out
    assert "without any target it raised ZeroDivisionError" in out and "float('nan')" in out
    assert ex07.fixed_window.check(_no_skip) is False
    assert "without any target it called optimizer.step()" in capsys.readouterr().out
    assert ex07.fixed_window.check(_returns_tensor) is False
    assert "it returned a tensor" in capsys.readouterr().out


def _package_window(model, optimizer, scheduler, window):
    # The notebook's package_window (section 1, above the exercise): the package's loop
    # does the whole window, count, skip and log included.
    objective = al.NextTokenLoss()
    return al.train_window(model, window, optimizer, objective, scheduler=scheduler).loss


def test_fixed_window_is_not_answered_by_the_package_loop_above_it(capsys):
    assert ex07.fixed_window.check(_package_window) is False
    out = capsys.readouterr().out
    assert "it calls al.train_window, the package's own loop" in out
    assert al.train_window.__module__ == "accumlab.loop"  # the check puts the loop back


def test_stub_is_not_attempted(capsys):
    assert ex07.fixed_window.check(stub) is False
    out = capsys.readouterr().out
    assert NOT_ATTEMPTED in out and "ex07.fixed_window.hint()" in out


def test_not_a_function(capsys):
    assert ex07.fixed_window.check(42) is False
    assert "expected a function, got int" in capsys.readouterr().out


def test_notebook_ships_the_exercise_unsolved():
    from helpers.notebook_exercises import assert_unsolved

    assert_unsolved("07_capstone.ipynb", {
        "fixed_window": "ex07", "diagnose": "ex07", "updates_predicted": "ex07"})


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


def diagnose_by_ratios(weights, targets, positions):
    # Written from the exercise text: math.isclose, fingerprints as a table, first match.
    import math

    a, total = len(weights), sum(targets)
    if any(math.isclose(w, 0.0, abs_tol=1e-6) for w in weights):
        return "missing_contributions"
    table = [
        ("ok", [1.0] * a),
        ("double_division", [1.0 / a] * a),
        ("average_of_averages", [total / a / t for t in targets]),
        ("ignored_tokens_counted", [total / sum(positions)] * a),
    ]
    for name, expected in table:
        if all(math.isclose(w, e, rel_tol=1e-4) for w, e in zip(weights, expected, strict=True)):
            return name
    return "unknown"


def diagnose_vectorised(weights, targets, positions):
    # Tensors and the largest relative deviation, in float64.
    w = torch.tensor(weights, dtype=torch.float64)
    t = torch.tensor(targets, dtype=torch.float64)
    if bool((w.abs() < 1e-6).any()):
        return "missing_contributions"
    candidates = {
        "ok": torch.ones_like(w),
        "double_division": torch.full_like(w, 1 / len(w)),
        "average_of_averages": t.sum() / (len(w) * t),
        "ignored_tokens_counted": torch.full_like(w, float(t.sum()) / sum(positions)),
    }
    for name, c in candidates.items():  # dicts keep the order: the first fit wins
        if float(((w - c).abs() / c).max()) < 1e-5:
            return name
    return "unknown"


def test_diagnose_accepts_answers_written_apart(capsys):
    for answer in (diagnose_by_ratios, diagnose_vectorised):
        assert ex07.diagnose.check(answer) is True, capsys.readouterr().out


def _zero_last(weights, targets, positions):
    # Reads the weights that reached the update first: misses a combined mistake.
    reached = [w for w in weights if abs(w) > 1e-6]
    if reached and all(abs(w - 1 / len(weights)) < 1e-4 for w in reached):
        return "double_division"
    return ex07.reference_diagnose(weights, targets, positions)


def test_diagnose_names_the_combined_rule(capsys):
    assert ex07.diagnose.check(_zero_last) is False
    assert "name missing_contributions first" in capsys.readouterr().out


def test_diagnose_cases_are_not_the_notebooks():
    import json
    from pathlib import Path

    shown = Path(__file__).resolve().parents[2] / "notebooks" / "07_capstone.ipynb"
    outputs = json.dumps([c.get("outputs", []) for c in json.loads(shown.read_text())["cells"]])
    for _, targets, positions, _ in ex07.DIAGNOSE_CASES:
        for values in (targets, positions):
            assert ", ".join(map(str, values)) not in outputs, values


def test_diagnose_reference_passes(capsys):
    assert ex07.diagnose.check(ex07.reference_diagnose) is True
    assert "✓ diagnose: correct" in capsys.readouterr().out


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
        (ex07.updates_predicted, 32, 128, "microbatches after the shrink"),
        (ex07.updates_predicted, 32, 16, "the effective batch"),
    ]:
        assert exercise.check(right) is True
        assert exercise.check(wrong) is False
        assert says in capsys.readouterr().out
        assert exercise.check(...) is False
        assert NOT_ATTEMPTED in capsys.readouterr().out


# ------------------------------------------------------------ the clinic's measurements
# Loops written here, apart from the notebook's, each with a known effect on what its user
# sees; the expected figures follow from the clinic's settings (A = 4, SGD at 0.1, warmup
# 0.1 × min(1, (u + 1) / 8)), not from ex07.symptoms.


def _sum_loss(model, mb):
    logits = model(input_ids=mb["input_ids"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                           ignore_index=-100, reduction="sum")


def _count(window):
    return sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)


def _right(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total, logged = _count(window), 0.0
    for mb in window:
        part = _sum_loss(model, mb)
        (part / total).backward()
        logged += float(part)
    optimizer.step()
    scheduler.step()
    return logged / total


def _twice(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total, logged = _count(window), 0.0
    for mb in window:
        loss = _sum_loss(model, mb) / total / len(window)
        loss.backward()
        logged += float(loss)
    optimizer.step()
    scheduler.step()
    return logged


def _means(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    for mb in window:
        (_sum_loss(model, mb) / _count([mb]) / len(window)).backward()
    optimizer.step()
    scheduler.step()


_kept = []


def _keeps(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    for mb in window:
        logits = model(input_ids=mb["input_ids"]).logits
        _kept.append(logits[:, -1])  # a view: the logits and their graph stay alive
        F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                        ignore_index=-100, reduction="sum").div(_count(window)).backward()
    optimizer.step()
    scheduler.step()


def _per_backward(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    for mb in window:
        (_sum_loss(model, mb) / _count(window)).backward()
        scheduler.step()
    optimizer.step()


def _never_steps(model, optimizer, scheduler, window):
    for mb in window:
        (_sum_loss(model, mb) / _count(window)).backward()
    scheduler.step()


def test_symptoms_of_a_right_loop():
    right = ex07.symptoms(_right)
    # The log is the first window's token mean at the starting weights, computed here in
    # one pass over the window's targets.
    first = ex07.clinic_windows(1)[0]
    model = ex07.clinic_model()
    with torch.no_grad():
        losses = torch.cat([F.cross_entropy(
            model(input_ids=mb["input_ids"]).logits[:, :-1].flatten(0, 1),
            mb["labels"][:, 1:].flatten(), ignore_index=-100, reduction="none")[
                mb["labels"][:, 1:].flatten() != -100] for mb in first])
    assert right.logged == pytest.approx(float(losses.mean()), rel=1e-5)
    assert right.split_gap < 1e-4 and right.growth_bytes == 0
    assert right.lr == pytest.approx(0.1 * 2 / 8)  # one scheduler.step: u = 1
    assert float(right.update.abs().max()) > 0


def test_symptoms_show_each_mistake():
    right = ex07.symptoms(_right)
    twice = ex07.symptoms(_twice)
    assert twice.logged / right.logged == pytest.approx(0.25, rel=1e-5)
    assert float(twice.update.norm() / right.update.norm()) == pytest.approx(0.25, rel=1e-4)
    assert ex07.symptoms(_means).split_gap > 0.01
    keeps = ex07.symptoms(_keeps)
    _kept.clear()
    assert keeps.growth_bytes > 0 and keeps.split_gap < 1e-4
    assert ex07.symptoms(_per_backward).lr == pytest.approx(0.1 * 5 / 8)  # u = 4 after A = 4
    never = ex07.symptoms(_never_steps)
    assert float(never.update.abs().max()) == 0 and never.split_gap == 0


def test_the_updates_prediction_holds_for_the_run():
    # 512 examples at 16 per update, whatever m the first window shrinks to.
    import accumlab as al
    from accumlab_course.data import VOCAB_SIZE, load_examples, microbatches
    from accumlab_course.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE, n_layer=1, n_embd=16)
    plan = al.AccumulationPlan(micro_batch_size=4, accumulation_steps=4)
    ledger = al.train(model, microbatches(load_examples(limit=512), 4),
                      torch.optim.SGD(model.parameters(), lr=0.1), plan, al.NextTokenLoss(),
                      progress=False)
    assert ledger.update_attempts == ex07.updates_predicted.answer


# ------------------------------------------------------------ the clinic's table


def _divides_twice(model, optimizer, scheduler, window):
    optimizer.zero_grad(set_to_none=True)
    total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
    logged = torch.zeros(())
    for mb in window:
        loss = _summed(model, mb) / total / len(window)
        loss.backward()
        logged += loss.detach()
    optimizer.step()
    scheduler.step()
    return float(logged)


def _summed(model, mb):
    logits = model(input_ids=mb["input_ids"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                           ignore_index=-100, reduction="sum")


def test_the_clinic_table_measures_each_loop_against_the_first(capsys):
    seen, reports = ex07.clinic_table([ex07.reference_fixed_window, _divides_twice])
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].split() == ["reference_fixed_window", "1.000", "1.000", "0%", "0.025", "0", "B", "ok"]
    # every contribution divided by A = 4 once more: a quarter of the log and of the update;
    # the learning rate after one window: 0.1 × (1 + 1) / 8
    assert rows[3].split() == ["_divides_twice", "0.250", "0.250", "0%", "0.025", "0", "B", "double_division"]
    assert reports["_divides_twice"].mistakes == ["double_division"]
    assert seen["_divides_twice"].logged == pytest.approx(seen["reference_fixed_window"].logged / 4)
