"""al.audit: correct loops pass, each classic mistake is named alone, combinations name all.

Every loop below is a user's ``train_one_window(model, optimizer, scheduler, window)``.
Each buggy loop differs from ``plain`` by the one mistake it is named after.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import accumlab as al
from accumlab.checks import MISTAKES, _weightings, audit_windows


def targets(window):
    return sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)


def logits_of(model, mb):
    return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits


def loss_sum(model, mb):
    logits = logits_of(model, mb)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)),
        mb["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def mean_loss(model, mb):
    logits = logits_of(model, mb)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), mb["labels"][:, 1:].reshape(-1)
    )


# --- three correct loops, written three ways ---------------------------------------------


def plain(model, optimizer, scheduler, window):
    optimizer.zero_grad(set_to_none=True)
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def no_sync_style(model, optimizer, scheduler, window):
    total = targets(window)
    for i, mb in enumerate(window):
        last = i == len(window) - 1
        sync = last or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            (loss_sum(model, mb) / total).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # cleared after the step, ready for the next window
    scheduler.step()


def token_weighted(model, optimizer, scheduler, window):
    optimizer.zero_grad(set_to_none=False)  # zeroed gradient tensors live on: not a leak
    total = sum(int(mb["labels"][:, 1:].ne(-100).sum()) for mb in window)
    logged = 0.0
    for mb in window:
        logits = model(**{k: v for k, v in mb.items() if k != "labels"}).logits
        per_token = F.cross_entropy(
            logits[:, :-1].transpose(1, 2), mb["labels"][:, 1:], reduction="none"
        )  # 0 at ignored positions
        part = per_token.sum()
        (part / total).backward()
        logged += part.item()
        del logits, per_token, part
    optimizer.step()
    scheduler.step()
    return logged / total


def hf_num_items(model, optimizer, scheduler, window):
    """Hugging Face style: the model's .loss summed and divided by num_items_in_batch."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        model(**mb, num_items_in_batch=total).loss.backward()
    optimizer.step()
    scheduler.step()


# --- one mistake each ------------------------------------------------------------------


def double_division(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total / len(window)).backward()
    optimizer.step()
    scheduler.step()


def average_of_averages(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    for mb in window:
        (mean_loss(model, mb) / len(window)).backward()
    optimizer.step()
    scheduler.step()


def hf_loss_over_a(model, optimizer, scheduler, window):
    """The model's own per-microbatch mean, divided by A: the average of averages again."""
    optimizer.zero_grad()
    for mb in window:
        (model(**mb).loss / len(window)).backward()
    optimizer.step()
    scheduler.step()


def ignored_tokens_counted(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = sum(mb["labels"][:, 1:].numel() for mb in window)  # -100 positions included
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def mask_counted(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = sum(int(mb["attention_mask"].sum()) for mb in window)  # prompt tokens included
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def zero_grad_in_window(model, optimizer, scheduler, window):
    total = targets(window)
    for mb in window:
        optimizer.zero_grad()
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def grads_dropped_by_hand(model, optimizer, scheduler, window):
    total = targets(window)
    for mb in window:
        for p in model.parameters():
            p.grad = None  # no zero_grad call to see: only the measured weights tell
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def no_update(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    scheduler.step()


def step_per_microbatch(model, optimizer, scheduler, window):
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        optimizer.step()
        optimizer.zero_grad()
    scheduler.step()


def scheduler_per_microbatch(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        scheduler.step()
    optimizer.step()


LOSSES: list = []


def kept_references(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        loss = loss_sum(model, mb) / total
        loss.backward()
        LOSSES.append(loss)  # the log keeps the tensor and its graph, window after window
    optimizer.step()
    scheduler.step()


OUTPUTS: list = []


def kept_logits(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        logits = logits_of(model, mb)
        OUTPUTS.append(logits.detach())  # no graph, but the activations stay
        F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            mb["labels"][:, 1:].reshape(-1),
            reduction="sum",
        ).div(total).backward()
    optimizer.step()
    scheduler.step()


# --- combinations ----------------------------------------------------------------------


def clinic_classic(model, optimizer, scheduler, window):
    """zero_grad, mean / A and the scheduler all inside the microbatch loop."""
    for mb in window:
        optimizer.zero_grad()
        (mean_loss(model, mb) / len(window)).backward()
        scheduler.step()
    optimizer.step()


def every_microbatch(model, optimizer, scheduler, window):
    """A loop without accumulation that still divides by A."""
    total = targets(window)
    for mb in window:
        optimizer.zero_grad()
        (loss_sum(model, mb) / total / len(window)).backward()
        optimizer.step()
        scheduler.step()


def mean_over_positions(model, optimizer, scheduler, window):
    """Mean over every position (ignored ones as zeros), per microbatch, / A twice."""
    optimizer.zero_grad()
    for mb in window:
        logits = logits_of(model, mb)
        per = F.cross_entropy(logits[:, :-1].transpose(1, 2), mb["labels"][:, 1:], reduction="none")
        (per.mean() / len(window) / len(window)).backward()
    optimizer.step()
    scheduler.step()


def forgot_step_and_kept(model, optimizer, scheduler, window):
    for mb in window:
        loss = mean_loss(model, mb)
        loss.backward()
        LOSSES.append(loss)
    scheduler.step()


CORRECT = [plain, no_sync_style, token_weighted, hf_num_items]
SINGLE = {
    double_division: "double_division",
    average_of_averages: "average_of_averages",
    hf_loss_over_a: "average_of_averages",
    ignored_tokens_counted: "ignored_tokens_counted",
    mask_counted: "ignored_tokens_counted",
    zero_grad_in_window: "zero_grad_in_window",
    grads_dropped_by_hand: "zero_grad_in_window",
    no_update: "no_update",
    step_per_microbatch: "step_per_microbatch",
    scheduler_per_microbatch: "scheduler_per_microbatch",
    kept_references: "kept_references",
    kept_logits: "kept_references",
}
COMBINED = {
    clinic_classic: ["average_of_averages", "zero_grad_in_window", "scheduler_per_microbatch"],
    every_microbatch: ["double_division", "step_per_microbatch", "scheduler_per_microbatch"],
    mean_over_positions: ["double_division", "average_of_averages", "ignored_tokens_counted"],
    forgot_step_and_kept: ["no_update", "kept_references"],
}

_reports: dict = {}


def report_of(loop):
    """Each loop is audited once per session (the audit runs a few dozen backward passes)."""
    if loop not in _reports:
        LOSSES.clear()
        OUTPUTS.clear()
        _reports[loop] = al.audit(loop)
        LOSSES.clear()
        OUTPUTS.clear()
    return _reports[loop]


def test_vocabulary_is_exactly_the_issues():
    assert MISTAKES == (
        "double_division",
        "average_of_averages",
        "ignored_tokens_counted",
        "zero_grad_in_window",
        "no_update",
        "step_per_microbatch",
        "scheduler_per_microbatch",
        "kept_references",
    )


@pytest.mark.parametrize("loop", CORRECT, ids=lambda f: f.__name__)
def test_correct_loops_pass(loop):
    report = report_of(loop)
    assert report.ok, str(report)
    assert report.mistakes == [] and report.other == []
    assert str(report).startswith("audit: ok")
    for w in report.windows:
        assert w.optimizer_steps == 1 and w.scheduler_steps == 1 and w.kept_tensors == 0
        assert w.update_error < 1e-10
        assert all(abs(x - 1) < 1e-9 for x in w.weights)  # every microbatch counted once


@pytest.mark.parametrize("loop", list(SINGLE), ids=lambda f: f.__name__)
def test_each_mistake_is_named_alone(loop):
    report = report_of(loop)
    name = SINGLE[loop]
    assert not report.ok
    assert report.mistakes == [name], str(report)
    assert report.other == [], str(report)
    text = str(report)
    symptom, fix = al.checks.ADVICE[name]
    assert f"- {name}" in text and symptom in text and fix in text
    assert report.evidence[name] in text


@pytest.mark.parametrize("loop", list(COMBINED), ids=lambda f: f.__name__)
def test_combinations_name_every_mistake(loop):
    report = report_of(loop)
    assert report.mistakes == COMBINED[loop], str(report)
    assert str(report).startswith(f"audit: {len(COMBINED[loop])} mistakes found")


def test_double_division_evidence_is_the_measured_ratio():
    report = report_of(double_division)
    assert "the update is 1/4 of the reference update" in report.evidence["double_division"]
    assert "1/2 in the window of 2 microbatches" in report.evidence["double_division"]
    for w in report.windows:
        assert all(abs(x - 1 / w.microbatches) < 1e-9 for x in w.weights)


def test_average_of_averages_weights_follow_one_over_the_microbatch_targets():
    report = report_of(average_of_averages)
    for w, window in zip(report.windows, audit_windows(), strict=True):
        for x, mb in zip(w.weights, window, strict=True):
            n = int((mb["labels"][:, 1:] != -100).sum())
            assert x == pytest.approx(w.targets / (len(window) * n), rel=1e-9)


def test_ignored_tokens_evidence_names_the_count_used():
    assert "label positions" in report_of(ignored_tokens_counted).evidence["ignored_tokens_counted"]
    assert "attention-mask" in report_of(mask_counted).evidence["ignored_tokens_counted"]


def test_counts_per_window_are_reported():
    steps = report_of(step_per_microbatch)
    assert [w.optimizer_steps for w in steps.windows] == [4, 4, 4, 2]
    assert "14 updates instead of 4" in steps.evidence["step_per_microbatch"]
    schedule = report_of(scheduler_per_microbatch)
    assert [w.scheduler_steps for w in schedule.windows] == [4, 4, 4, 2]
    assert [w.optimizer_steps for w in report_of(no_update).windows] == [0, 0, 0, 0]
    zeroed = report_of(zero_grad_in_window)
    assert [w.cleared_gradients for w in zeroed.windows] == [3, 3, 3, 1]
    assert zeroed.windows[0].weights == pytest.approx([0, 0, 0, 1], abs=1e-9)


def test_kept_references_counts_what_each_window_left():
    report = report_of(kept_references)
    assert [w.kept_tensors for w in report.windows] == [4, 4, 4, 2]  # one loss per microbatch
    assert "attached to an autograd graph" in report.evidence["kept_references"]


def test_gradients_never_cleared_is_reported_outside_the_vocabulary():
    def never_cleared(model, optimizer, scheduler, window):
        total = targets(window)
        for mb in window:
            (loss_sum(model, mb) / total).backward()
        optimizer.step()
        scheduler.step()

    report = al.audit(never_cleared)
    assert not report.ok and report.mistakes == []
    assert len(report.other) == 1 and "earlier windows were still in .grad" in report.other[0]


SCALARS: list = []


def test_logging_detached_scalars_is_not_a_kept_reference():
    def logs_detached(model, optimizer, scheduler, window):
        optimizer.zero_grad()
        total = targets(window)
        for mb in window:
            part = loss_sum(model, mb)
            (part / total).backward()
            SCALARS.append(part.detach())  # a 0-d tensor without a graph
        optimizer.step()
        scheduler.step()

    report = al.audit(logs_detached)
    SCALARS.clear()
    assert report.ok, str(report)


def test_undivided_loss_sums_are_reported_outside_the_vocabulary():
    def undivided(model, optimizer, scheduler, window):
        optimizer.zero_grad()
        for mb in window:
            loss_sum(model, mb).backward()
        optimizer.step()
        scheduler.step()

    report = al.audit(undivided)
    assert report.mistakes == [] and not report.ok
    assert report.other == [
        "the loss sums are not divided at all: every update is as many times too large as the "
        "window has targets"
    ]
    assert report.windows[0].weights == pytest.approx([38] * 4)  # the window's 38 targets


def test_a_scheduler_never_stepped_is_reported():
    def without_scheduler(model, optimizer, scheduler, window):
        optimizer.zero_grad()
        total = targets(window)
        for mb in window:
            (loss_sum(model, mb) / total).backward()
        optimizer.step()

    report = al.audit(without_scheduler)
    assert not report.ok and report.mistakes == []
    assert "scheduler.step() was never called" in report.other[0]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="train_one_window"):
        al.audit("plain")
    with pytest.raises(TypeError, match=r"four arguments \(model, optimizer, scheduler"):
        al.audit(lambda model, optimizer, window: None)
    with pytest.raises(TypeError, match="four arguments"):
        al.audit(lambda model, optimizer, scheduler, window, extra: None)


def test_errors_in_the_loop_propagate_with_the_window():
    def broken(model, optimizer, scheduler, window):
        raise KeyError("input_idz")

    with pytest.raises(KeyError) as info:
        al.audit(broken)
    assert any("audit window 0" in note for note in info.value.__notes__)


def test_audit_leaves_the_global_random_state_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    al.audit(plain)
    assert torch.equal(torch.get_rng_state(), state)


def test_controlled_set_separates_every_weighting_on_every_microbatch():
    """The fingerprints only work if no two candidate denominators coincide."""
    for window in audit_windows():
        counts = [int((mb["labels"][:, 1:] != -100).sum()) for mb in window]
        assert min(counts) > 0 and len(set(counts)) == len(counts)
        assert all(int(mb["labels"][:, 0].ne(-100).sum()) == 0 for mb in window)
        candidates = _weightings(window)
        for i in range(len(window)):
            values = sorted(d[i] for _, d in candidates)
            assert all(b > a * (1 + 1e-3) for a, b in zip(values, values[1:], strict=False))
