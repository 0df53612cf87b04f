"""al.audit: the vocabulary, the evidence each mistake quotes, the report's contract.

The exact verdict of every loop of the corpus (tests/helpers/audit_loops.py) is checked in
tests/audit/test_audit_corpus.py; this file checks what the reports say about them, and the
audit's own contract (arguments, errors, random state, the controlled set).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest
import torch
from helpers import audit_loops as loops

import accumlab as al
from accumlab.loop_audit.controlled_set import (
    AUDIT_TOLERANCE,
    AUDIT_WINDOWS,
    audit_windows,
    window_rows,
)
from accumlab.loop_audit.report import NOT_CHECKED
from accumlab.loop_audit.weightings import MEAN_BY_EXAMPLES, PER_EXAMPLE, weightings
from accumlab.mistakes import MISTAKES

report_of = loops.report_of


@pytest.mark.parametrize(
    "loop", [loops.plain, loops.per_row, loops.hf_num_items], ids=lambda f: f.__name__
)
def test_a_correct_loop_counts_every_example_once(loop):
    report = report_of(loop)
    assert report.ok and str(report).startswith(
        "audit: ok (4 windows, 15 microbatches, 30 examples of a controlled set)"
    )
    for w in report.windows:
        assert w.optimizer_steps == 1 and w.scheduler_steps == 1 and w.kept_tensors == 0
        assert w.scheduler_ahead == 0
        assert w.update_error < 1e-10 and w.label_shift == 1
        assert all(abs(x - 1) < 1e-9 for mb in w.example_weights for x in mb)
        assert all(n == 1 for mb in w.example_backward_passes for n in mb)


def test_ok_requires_the_update_to_match_within_the_tolerance():
    """An 'ok' text never quotes a large error: ok needs every update within tolerance."""
    report = report_of(loops.plain)
    off = dataclasses.replace(report.windows[0], update_error=0.81)
    wrong = al.AuditReport([], {}, [], [off, *report.windows[1:]])
    assert not wrong.ok
    assert not str(wrong).startswith("audit: ok")
    assert AUDIT_TOLERANCE == 1e-6


def test_lost_microbatches_are_named_with_the_missing_targets():
    report = report_of(loops.skips_first)
    assert report.mistakes == ["lost_microbatches"]
    assert report.windows[0].weights == pytest.approx([0, 1, 1, 1], abs=1e-9)
    assert [w.example_backward_passes[0] for w in report.windows] == [
        [0, 0],
        [0],
        [0, 0],
        [0, 0, 0],
    ]
    evidence = report.evidence["lost_microbatches"]
    assert evidence.startswith("window 0: microbatch 0; window 1: microbatch 0;")
    assert (
        "never reached a backward pass whole (44 of the controlled set's 155 targets)" in evidence
    )


def test_a_backward_pass_after_the_last_step_is_a_lost_microbatch():
    report = report_of(loops.steps_before_last_microbatch)
    assert report.mistakes == ["lost_microbatches"] and report.other == []
    assert report.windows[0].weights == pytest.approx([1, 1, 1, 0], abs=1e-9)
    assert report.evidence["lost_microbatches"].startswith(
        "window 0: microbatch 3; window 1: microbatch 3; window 2: microbatch 3; window 3: "
        "microbatch 2 reached a backward pass only after the window's last optimizer.step()"
    )
    stale = report_of(loops.steps_first)
    assert stale.other[0].startswith("windows 1, 2, 3: optimizer.step() applied only gradients")


def test_a_lost_row_is_named_by_its_example():
    evidence = report_of(loops.drops_last_row).evidence["lost_microbatches"]
    assert evidence.startswith("window 0: example 1 of microbatch 0, example 2 of microbatch 2")


def test_training_only_the_last_microbatch_is_lost_microbatches_not_a_weighting():
    report = report_of(loops.only_last_microbatch)
    assert report.mistakes == ["lost_microbatches"] and report.other == []
    assert report.windows[0].weights[:3] == [0, 0, 0]


def test_a_microbatch_trained_twice_is_duplicated():
    report = report_of(loops.first_microbatch_twice)
    assert report.mistakes == ["duplicated_microbatch"]
    assert report.windows[0].weights == pytest.approx([2, 1, 1, 1], abs=1e-9)
    assert report.windows[0].example_backward_passes[0] == [2, 2]
    assert report.evidence["duplicated_microbatch"].startswith("window 0: microbatch 0 (2 ×);")


@pytest.mark.parametrize(
    ("loop", "shift", "words"),
    [
        (loops.labels_not_shifted, 0, "its own input token (labels[:, t], no shift)"),
        (loops.shifts_in_place_then_hf, 2, "two places ahead (labels[:, t + 2], shifted twice)"),
    ],
    ids=["not_shifted", "shifted_twice"],
)
def test_misaligned_labels_are_named_by_their_shift(loop, shift, words):
    report = report_of(loop)
    name = "labels_not_shifted" if shift == 0 else "labels_shifted_twice"
    assert name in report.mistakes and "zero_grad_in_window" not in report.mistakes
    assert all(w.label_shift == shift for w in report.windows)
    assert words in report.evidence[name]
    assert report.other == []  # not "carried gradients", not "not a combination"


def test_labels_changed_in_place_are_reported():
    report = report_of(loops.shifts_in_place)
    assert report.mistakes == ["window_modified_in_place"]
    assert (
        "labels of microbatch 0 of window 0 (shifted one position left in place)"
        in (report.evidence["window_modified_in_place"])
    )
    assert "the loop changed 15 tensors" in report.evidence["window_modified_in_place"]


@pytest.mark.parametrize(
    "loop",
    [loops.logs_no_grad_loss_first, loops.eval_forward_first, loops.forward_without_backward_first],
    ids=lambda f: f.__name__,
)
def test_forward_passes_without_backward_are_not_counted(loop):
    report = report_of(loop)
    assert report.ok, str(report)
    assert all(w.forwards > w.microbatches for w in report.windows[:3])  # extra forwards ran
    assert all(w.carried < 1e-9 for w in report.windows)


def test_double_division_evidence_is_the_measured_ratio():
    report = report_of(loops.double_division)
    assert "the update is 1/4 of the reference update" in report.evidence["double_division"]
    assert "1/3 in the window of 3 microbatches" in report.evidence["double_division"]
    for w in report.windows:
        assert all(abs(x - 1 / w.microbatches) < 1e-9 for x in w.weights)


def test_average_of_averages_weights_follow_one_over_the_microbatch_targets():
    report = report_of(loops.average_of_averages)
    for w, window in zip(report.windows, audit_windows(), strict=True):
        for x, mb in zip(w.weights, window, strict=True):
            n = int((mb["labels"][:, 1:] != -100).sum())
            assert x == pytest.approx(w.targets / (len(window) * n), rel=1e-9)


def test_per_example_means_are_an_average_of_averages_over_examples():
    report = report_of(loops.per_row_means)
    assert (
        "(targets in the example × examples in the window)"
        in report.evidence["average_of_averages"]
    )
    rows = window_rows(audit_windows())
    for w, examples in zip(report.windows, rows, strict=True):
        flat = [x for mb in w.example_weights for x in mb]
        for x, row in zip(flat, examples, strict=True):
            assert x == pytest.approx(w.targets / (row.targets * len(examples)), rel=1e-9)


def test_ignored_tokens_evidence_names_the_count_used():
    assert (
        "label positions"
        in report_of(loops.ignored_tokens_counted).evidence["ignored_tokens_counted"]
    )
    assert "attention-mask" in report_of(loops.mask_counted).evidence["ignored_tokens_counted"]


def test_counts_per_window_are_reported():
    steps = report_of(loops.step_per_microbatch)
    assert [w.optimizer_steps for w in steps.windows] == [4, 4, 4, 3]
    assert "15 updates instead of 4" in steps.evidence["step_per_microbatch"]
    schedule = report_of(loops.scheduler_per_microbatch)
    assert [w.scheduler_steps for w in schedule.windows] == [4, 4, 4, 3]
    assert "scheduler_before_optimizer" not in schedule.mistakes  # ahead, named once
    assert [w.optimizer_steps for w in report_of(loops.no_update).windows] == [0, 0, 0, 0]
    zeroed = report_of(loops.zero_grad_in_window)
    assert [w.cleared_gradients for w in zeroed.windows] == [3, 3, 3, 2]
    assert zeroed.windows[0].weights == pytest.approx([0, 0, 0, 1], abs=1e-9)


def test_clipping_after_every_backward_pass_is_named_clip_per_microbatch():
    """Clipping a partial sum of the window's gradient is its own mistake, not a zero_grad
    in the window (the weights of the early microbatches fall to ~1e-9, but nothing was
    cleared): its fix is to clip once, after the last backward pass, before step."""
    for loop in (
        loops.clips_every_microbatch,
        loops.clips_every_microbatch_mildly,
        loops.clips_before_each_backward,
        loops.clips_values_every_microbatch,
    ):
        report = report_of(loop)
        assert report.mistakes == ["clip_per_microbatch"] and report.other == [], str(report)
        assert "clip once per window" in MISTAKES["clip_per_microbatch"].fix
    report = report_of(loops.clips_every_microbatch)
    assert all(w.cleared_gradients == 0 for w in report.windows)
    evidence = report.evidence["clip_per_microbatch"]
    assert evidence.startswith(
        "the gradient shrank between two backward passes of the same window 3, 3, 3, 2 times "
        "(windows 0, 1, 2, 3)"
    ), evidence
    # a threshold the partial sums never reach changes nothing: not named
    assert report_of(loops.clips_every_microbatch_above_the_norm).ok
    # clipping once, after the last backward pass, is right (below the norm: a factor)
    assert report_of(loops.clipped_below_the_norm).mistakes == []


def test_kept_references_counts_what_each_window_left():
    report = report_of(loops.kept_losses)
    assert [w.kept_tensors for w in report.windows] == [4, 4, 4, 3]  # one loss per microbatch
    assert "attached to an autograd graph" in report.evidence["kept_references"]


def test_gradients_never_cleared_are_reported_outside_the_vocabulary():
    report = report_of(loops.never_cleared)
    assert not report.ok and report.mistakes == []
    assert len(report.other) == 1 and "earlier windows were still in .grad" in report.other[0]


def test_undivided_loss_sums_are_reported_outside_the_vocabulary():
    report = report_of(loops.undivided)
    assert report.mistakes == [] and not report.ok
    assert report.other == [
        "the loss sums are not divided at all: every update is as many times too large as the "
        "window has targets"
    ]
    assert report.windows[0].weights == pytest.approx([38] * 4)  # the window's 38 targets


def test_a_uniform_factor_is_described_as_one():
    for loop in (loops.clipped_below_the_norm, loops.doubled_loss):
        report = report_of(loop)
        assert report.mistakes == [] and any("times a factor" in o for o in report.other)
    report = report_of(loops.divides_by_examples)  # 8, 8, 8 and 6 examples per window
    targets = ", ".join(str(w.targets) for w in report.windows)
    assert (
        f"as if the loss sums were divided by 8, 8, 8, 6 in windows 0, 1, 2, 3 instead of their "
        f"{targets} targets" in report.other[-1]
    )


def test_a_scheduler_never_stepped_is_reported():
    report = report_of(loops.without_scheduler)
    assert not report.ok and report.mistakes == []
    assert "scheduler.step() was never called" in report.other[0]


def test_the_audit_says_what_it_does_not_check():
    for loop in (loops.plain, loops.double_division):
        assert loops.flat(str(report_of(loop))).endswith(loops.flat(NOT_CHECKED))
    for words in ("non-finite gradients", "mixed precision", "clipping", "no_sync"):
        assert words in NOT_CHECKED
    doc = " ".join(al.audit.__doc__.split())
    assert "What it does not check: non-finite gradients" in doc
    assert "within :data:`AUDIT_TOLERANCE`" in doc


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
    al.audit(loops.plain)
    assert torch.equal(torch.get_rng_state(), state)


def test_controlled_set_separates_every_weighting_on_every_microbatch():
    """The fingerprints only work if no two candidate denominators coincide: those of the
    targets, label positions and mask tokens differ on every microbatch, and every pair of
    candidates (the counts before the shift and the mask tokens after it included) differs
    on some example of every window."""
    original = ("targets", "label positions", "attention-mask tokens")
    for window, rows in zip(audit_windows(), window_rows(audit_windows()), strict=True):
        counts = [int((mb["labels"][:, 1:] != -100).sum()) for mb in window]
        assert min(counts) > 0 and len(set(counts)) == len(counts)
        candidates = weightings(rows)
        per_microbatch = [
            (w, d)
            for w, d in candidates
            if w.unit in original and w.key not in (PER_EXAMPLE, MEAN_BY_EXAMPLES)
        ]
        for i in range(len(window)):
            first = next(j for j, row in enumerate(rows) if row.microbatch == i)
            values = sorted(d[first] for _, d in per_microbatch)
            assert all(b > a * (1 + 1e-3) for a, b in zip(values, values[1:], strict=False))
        for (w1, d1), (w2, d2) in itertools.combinations(candidates, 2):
            assert any(abs(x - y) > 1e-3 * y for x, y in zip(d1, d2, strict=True)), (w1, w2)


def test_controlled_set_has_first_label_targets_and_an_odd_window():
    """Every window holds a row whose first label is a target (a count taken before the
    shift differs from the target count in every window), and a window holds an odd number
    of microbatches (a loop that pairs them drops one)."""
    for window in audit_windows():
        assert any(int(mb["labels"][:, 0].ne(-100).sum()) > 0 for mb in window)
    assert any(len(window) % 2 for window in audit_windows())
    assert [len(w) for w in AUDIT_WINDOWS] == [4, 4, 4, 3]


def test_controlled_set_examples_are_told_apart_by_their_tokens():
    """A forward pass is matched to examples by their real tokens (padding may be cut or
    added): no example's tokens may start another example's of the same window."""
    for rows in window_rows(audit_windows()):
        for a in rows:
            for b in rows:
                n = a.tokens.numel()
                if a is not b and n <= b.tokens.numel():
                    assert not torch.equal(b.tokens[:n], a.tokens)


def test_a_buffer_made_once_is_not_a_leak_and_the_ok_text_says_so():
    report = report_of(loops.makes_a_cache_once)
    assert report.ok and [w.kept_tensors for w in report.windows] == [1, 0, 0, 0]
    text, plain = loops.flat(str(report)), loops.flat(str(report_of(loops.plain)))
    assert "no tensor outlived its window but 1 made once in the first window." in text
    assert "no tensor outlived its window." in plain


def test_audit_has_one_public_address():
    """``accumlab.audit`` (and ``accumlab.AuditReport``), imported from the modules that
    define them; neither ``accumlab.checks`` nor the subpackage re-exports them."""
    import accumlab.checks
    import accumlab.loop_audit

    assert al.audit.__module__ == "accumlab.loop_audit.run" and callable(al.audit)
    assert al.AuditReport.__module__ == "accumlab.loop_audit.report"
    for name in ("audit", "AuditReport", "MISTAKES", "ADVICE", "AuditLM", "audit_windows"):
        assert not hasattr(accumlab.checks, name), name
        assert name not in vars(accumlab.loop_audit), name


def test_a_count_taken_before_the_shift_is_named_with_the_rows_that_start_with_a_target():
    for loop in (loops.counts_before_shift, loops.hf_num_items_before_shift):
        report = report_of(loop)
        assert report.mistakes == ["count_before_shift"] and report.other == []
        for w, rows in zip(report.windows, window_rows(audit_windows()), strict=True):
            counted = sum(row.labels for row in rows)  # one more per row without a prompt
            assert counted > w.targets
            assert w.weights == pytest.approx([w.targets / counted] * w.microbatches, rel=1e-9)
        evidence = report.evidence["count_before_shift"]
        assert "10, 8, 13, 7 targets but 10, 8, 14, 7 labels before the shift" in evidence
        assert "the first label of example 0 of microbatch 2 is a target" in evidence
    # the same count with each row's first label taken off again is the target count: ok
    assert report_of(loops.counts_after_the_shift_with_first_targets).ok


def test_a_loss_without_the_shift_scores_the_first_label_so_its_count_is_not_named():
    """A loop that does not shift scores labels[:, 0] too: the unshifted count matches what
    it scores, and the mistake is the shift (with the average of averages), not the count."""
    report = report_of(loops.hf_labels_not_shifted_mean)
    assert set(report.mistakes) == {"labels_not_shifted", "average_of_averages"}


def test_scheduler_stepped_before_the_optimizer_is_named_with_the_counts():
    for loop in (loops.scheduler_before_step, loops.scheduler_at_window_start):
        report = report_of(loop)
        assert report.mistakes == ["scheduler_before_optimizer"] and report.other == []
        assert [w.scheduler_ahead for w in report.windows] == [1, 1, 1, 1]
        assert report.evidence["scheduler_before_optimizer"].startswith(
            "at the first optimizer.step() of windows 0, 1, 2, 3 the scheduler had already "
            "been stepped 1, 2, 3, 4 times for 0, 1, 2, 3 earlier updates"
        )
        assert "the schedule gives the next update" in report.evidence["scheduler_before_optimizer"]
    # the order alone decides: calls per window are right, and the updates are exact
    report = report_of(loops.scheduler_before_step)
    assert all(w.update_error < 1e-10 for w in report.windows)
    assert all(w.scheduler_steps == 1 == w.optimizer_steps for w in report.windows)
    # falling behind is not "before": a schedule stepped every other window is another note
    assert (
        "scheduler_before_optimizer" not in report_of(loops.scheduler_every_other_window).mistakes
    )


def test_pairs_of_microbatches_lose_the_last_of_the_odd_window():
    report = report_of(loops.pairs_microbatches)
    assert report.mistakes == ["lost_microbatches"] and report.other == []
    assert report.windows[3].weights == pytest.approx([1, 1, 0], abs=1e-9)
    assert all(w.weights == pytest.approx([1] * 4, abs=1e-9) for w in report.windows[:3])
    assert report.evidence["lost_microbatches"].startswith(
        "window 3: microbatch 2 never reached a backward pass whole (12 of the controlled set's "
        "155 targets)"
    )
    assert "zip(window[0::2], window[1::2])" in MISTAKES["lost_microbatches"].fix
    assert report_of(loops.pairs_with_the_odd_one).ok


def test_mask_tokens_after_the_shift_are_ignored_tokens_counted():
    report = report_of(loops.mask_minus_one_per_row)
    assert report.mistakes == ["ignored_tokens_counted"] and report.other == []
    evidence = report.evidence["ignored_tokens_counted"]
    assert "attention-mask tokens minus one per row (shifted, but the prompt included)" in evidence
    assert "10, 8, 13, 7 targets but 13, 11, 19, 10 attention-mask tokens after the shift" in (
        evidence
    )


def test_microbatch_means_weighted_by_their_examples_are_an_average_of_averages():
    report = report_of(loops.mean_weighted_by_examples)
    assert report.mistakes == ["average_of_averages"] and report.other == []
    for w, window in zip(report.windows, audit_windows(), strict=True):
        n = sum(mb["input_ids"].shape[0] for mb in window)
        for x, mb in zip(w.weights, window, strict=True):
            t = int((mb["labels"][:, 1:] != -100).sum())
            assert x == pytest.approx(w.targets * mb["input_ids"].shape[0] / (n * t), rel=1e-9)
    assert (
        "each microbatch's mean is weighted by its examples"
        in (report.evidence["average_of_averages"])
    )


def test_the_report_counts_what_the_audit_ran():
    """The examples, the loop's forward passes and the audit's own: the text says them and
    the report exposes them (not '28 examples' for 42 forward passes)."""
    examples = sum(int(mb["input_ids"].shape[0]) for w in audit_windows() for mb in w)
    report = report_of(loops.plain)
    assert report.examples == examples == 30 and report.microbatches == 15
    assert (report.loop_forwards, report.loop_rows, report.reference_forwards) == (15, 30, 30)
    assert (report.forward_passes, report.rows_forwarded) == (45, 60)
    assert "The audit ran 45 forward passes over 60 rows: your loop's 15 over 30 rows, and 30 " in (
        loops.flat(str(report))
    )
    per_row = report_of(loops.per_row)  # one forward pass per example
    assert (per_row.loop_forwards, per_row.loop_rows) == (30, 30)
    extra = report_of(loops.logs_no_grad_loss_first)  # a no-grad forward before each one
    assert extra.loop_forwards == 2 * report.loop_forwards and extra.reference_forwards == 30
    # a loop trained on misaligned labels costs the audit its contributions at two shifts
    assert report_of(loops.labels_not_shifted).reference_forwards == 2 * examples
    # a mistaken report says it too, before what the audit does not check
    mistaken = report_of(loops.double_division)
    text = str(mistaken)
    assert any(line.startswith("The audit ran ") for line in text.splitlines())
    assert loops.flat(text).endswith(loops.flat(f"{mistaken.ran} {NOT_CHECKED}"))
    doc = " ".join(al.audit.__doc__.split())
    sizes = ", ".join(str(len(w)) for w in AUDIT_WINDOWS[:-1]) + f" and {len(AUDIT_WINDOWS[-1])}"
    assert f"four windows ({sizes} microbatches, {examples} examples" in doc
    assert "a correct loop costs 45 forward passes over 60 rows" in doc


def test_a_report_prints_without_the_shared_explanation():
    """``text(explain=False)`` is the report without its two closing paragraphs (what the
    audit ran, what it does not check), which ``explanation`` holds, to print once."""
    for loop in (loops.plain, loops.review_window):
        report = report_of(loop)
        short, explanation = report.text(explain=False), report.explanation
        assert str(report) == report.text() == f"{short}\n{explanation}"
        assert "Not checked by the audit" not in short and "The audit ran" not in short
        assert loops.flat(explanation) == loops.flat(f"{report.ran} {NOT_CHECKED}")
        assert max(len(line) for line in explanation.splitlines()) <= 100


NEW_LOOPS = [
    loops.counts_before_shift,
    loops.hf_num_items_before_shift,
    loops.mask_minus_one_per_row,
    loops.mean_weighted_by_examples,
    loops.scheduler_before_step,
    loops.pairs_microbatches,
    loops.pairs_with_the_odd_one,
    loops.counts_after_the_shift_with_first_targets,
    loops.plain,
]


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("loop", NEW_LOOPS, ids=lambda f: f.__name__)
def test_the_new_fingerprints_hold_under_other_token_draws(loop, seed):
    expected = loops.EXPECTED[loop]
    loops.LOG.clear()
    report = al.audit(loop, seed=seed)
    assert set(report.mistakes) == expected.mistakes and report.ok == expected.ok, str(report)


def test_the_workshop_mystery_loops_get_the_verdicts_its_table_states():
    """docs/WORKSHOP.md's mystery loops, run as printed, against its table."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "WORKSHOP.md").read_text()
    start = text.rindex("```python", 0, text.index("def mystery_a"))
    code = text[start + len("```python") : text.index("```", text.index("def mystery_a"))]
    namespace: dict = {}
    exec(compile(code, "WORKSHOP.md", "exec"), namespace)
    rows = dict(re.findall(r"^\| `(mystery_\w)` \| `([^`]+)` \|", text, flags=re.M))
    assert set(rows) == {"mystery_a", "mystery_b", "mystery_c"}
    for name, stated in rows.items():
        report = al.audit(namespace[name])
        assert ("ok" if report.ok else str(report.mistakes)) == stated, (name, str(report))
