"""The mistakes the audits name: one table for every audit and check.

Each name in :data:`MISTAKES` has a :class:`Mistake`: its cause (what the code does), the
symptom a user sees in a real run, the fix, and which audits can report it —
``"loop"`` (:func:`accumlab.audit`, a window loop on a controlled set), ``"trainer"``
(:func:`accumlab.hf.audit_trainer`, a Hugging Face ``Trainer`` job) and ``"split"`` (the
split-invariance engine, :mod:`accumlab.invariance`, which :func:`accumlab.split_invariance`,
the Lightning callback and the Trainer and RL adapters share). :func:`reported_by` gives an
audit's names in the table's order, the order every report lists them.

The split-invariance engine (the job's own gradient for the same examples under several
splits) names a factor of exactly ``1/A`` ``double_division``, a factor of ``A`` (or the
sum of the microbatches' own gradients) ``sum_of_means``, ``1/A`` times that sum
``average_of_averages``, a short window scaled by its microbatches over the configured
``A`` ``short_window_divided_by_a``, and any other dependence ``depends_on_split``; against
an intended objective, ``wrong_normalization`` or ``not_token_mean``. An adapter may give a name by its cause in
its framework (``check_splits(..., rename=...)``: a Trainer's ``sum_of_means`` is its
``num_items_ignored``).

A leaf of the layers: it imports nothing from accumlab.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The audits that report mistakes: ``"loop"`` is :func:`accumlab.audit`, ``"trainer"`` is
#: :func:`accumlab.hf.audit_trainer` (and its ``AuditCallback``), ``"split"`` is the
#: split-invariance engine (:mod:`accumlab.invariance`) and every adapter built on it.
AUDITS: tuple[str, ...] = ("loop", "trainer", "split")


@dataclass(frozen=True)
class Mistake:
    """One named mistake: ``cause`` (what the code does wrong), ``symptom`` (what a user
    sees in a real run), ``fix`` (what to change), ``audits`` (which of :data:`AUDITS`
    can report it)."""

    cause: str
    symptom: str
    fix: str
    audits: frozenset[str]


def _both(cause: str, symptom: str, fix: str, *more: str) -> Mistake:
    return Mistake(cause, symptom, fix, frozenset({"loop", "trainer", *more}))


def _loop(cause: str, symptom: str, fix: str) -> Mistake:
    return Mistake(cause, symptom, fix, frozenset({"loop"}))


def _trainer(cause: str, symptom: str, fix: str, *more: str) -> Mistake:
    return Mistake(cause, symptom, fix, frozenset({"trainer", *more}))


def _split(cause: str, symptom: str, fix: str) -> Mistake:
    return Mistake(cause, symptom, fix, frozenset({"split"}))


#: Every mistake an audit can name, in the order the reports list them.
MISTAKES: dict[str, Mistake] = {
    "double_division": _both(
        "the loss is divided twice: by the window's count and again, by A or by another "
        "count (an extra / A on top of a loss already normalized over the window)",
        "an abnormally small loss and updates A times too small (with SGD the run looks like "
        "one with a learning rate A times lower; Adam's normalization mostly hides the scale)",
        "divide each microbatch's loss sum once, by the window's target count; no extra / A "
        "(and none on top of a framework that already normalizes)",
        "split",
    ),
    "average_of_averages": _both(
        "each microbatch's (or example's) loss is its own mean and the means are averaged: "
        "a target in a short microbatch weighs more than one in a long microbatch",
        "a result that depends on how the examples are split into microbatches: a target in "
        "a short microbatch weighs more than one in a long microbatch",
        "sum the token losses (reduction='sum') and divide by the target count of the whole "
        "window, counted before the forward passes; never average the microbatch means",
        "split",
    ),
    "sum_of_means": _split(
        "each microbatch's loss is normalized on its own (its mean) and the window adds them "
        "up without dividing by A, or the loss is multiplied by an A nothing divides by",
        "updates about A times too large that weight each target by its microbatch: the "
        "result depends on A and on how the examples are split",
        "sum the token losses (reduction='sum') and divide by the target count of the whole "
        "window; where the framework divides by A (Lightning, Accelerate), let it, and "
        "multiply by A only what it divides",
    ),
    "short_window_divided_by_a": Mistake(
        "a window with fewer microbatches than A (the last of an epoch) still divides each "
        "loss by the configured A: its gradient is scaled by its microbatches over A",
        "the last update of every epoch is too small (one microbatch of A: 1/A of its size), "
        "and more so the shorter the last window",
        "divide by the window's own count (its targets, or its number of microbatches); in "
        "Lightning, drop the short last window (a sampler with drop_last, or a data set "
        "whose length is a multiple of m × A) or multiply by A / its microbatches",
        frozenset({"loop", "split"}),
    ),
    "ignored_tokens_counted": _both(
        "the loss is divided by a count that includes positions it never scores (padding, "
        "prompt, -100 labels, attention-mask tokens)",
        "a result that depends on padding and prompt length, and a loss that looks too small: "
        "the denominator counts positions that have no target",
        "count only supervised targets after the shift: (labels[:, 1:] != -100).sum()",
    ),
    "count_before_shift": _both(
        "the count is taken over the labels before the causal shift, so each row whose first "
        "label is a target adds one that no prediction scores (num_items_in_batch counted "
        "that way too)",
        "updates a little too small, by targets / (targets + rows without a prompt): the count "
        "is taken before the shift, so each row whose first label is a target adds one that "
        "no prediction scores (the shortfall grows with more, shorter rows per window)",
        "count the targets after the shift, the positions the loss scores: "
        "(labels[:, 1:] != -100).sum(), also for num_items_in_batch when the model shifts "
        "the labels itself",
    ),
    "scored_targets_missed": _trainer(
        "the loss is divided by a count that misses targets the loss scores",
        "updates a little too large, by the scored targets over the count",
        "count exactly the targets the loss scores, after the shift and after every mask the "
        "collator applies, over the whole window and every rank",
    ),
    "num_items_ignored": _trainer(
        "each microbatch's loss is its own mean, because the model (or a compute_loss "
        "override) ignores num_items_in_batch or is never given it, and the Trainer no "
        "longer divides by the accumulation steps",
        "updates about A times too large that weight each target by its microbatch: the "
        "result depends on how the examples are split",
        "make the loss use num_items_in_batch: sum the losses over the microbatch and divide "
        "by it (a compute_loss_func does this for any model)",
    ),
    "per_rank_mean": _trainer(
        "each data-parallel rank divides by its own target count and the ranks' gradients "
        "are averaged: a target on a rank with fewer targets weighs more",
        "a result that depends on how the examples are spread over the ranks: small with "
        "even lengths, large with uneven ones",
        "divide by the window's target count summed over all ranks, times D "
        "(average_tokens_across_devices=True in a Trainer)",
    ),
    "no_division": _trainer(
        "the loss sums are never divided by the window's count",
        "updates as many times too large as the window has targets, and a loss that grows "
        "with the batch",
        "divide each microbatch's loss sum by the window's target count",
    ),
    "wrong_normalization": _trainer(
        "every target weighs the same, but the loss is divided by a count the audit cannot name",
        "updates too large or too small by one constant factor (with SGD, a learning rate "
        "off by that factor)",
        "divide the summed loss by the window's target count (all microbatches, all ranks) "
        "and by nothing else",
        "split",
    ),
    "not_token_mean": _trainer(
        "the gradient is no weighting of the objective's per-microbatch gradients: the loss "
        "is not the audited mean (label smoothing, a custom weighting, a different loss)",
        "none the audit can tell: the training loss is not the objective it compared with",
        "pass the loss you mean as objective= (an Objective with count and loss_sum), or "
        "make the loss a sum over targets divided by the window's count",
        "split",
    ),
    "depends_on_split": _trainer(
        "the job's gradient for the same examples changes with how they are split into "
        "microbatches: the loss normalizes or weighs something per microbatch (a mean, a "
        "per-microbatch statistic) instead of over the window",
        "the same data gives another update at another microbatch size or accumulation "
        "count: changing A to fit memory changes the training",
        "compute every normalizer and statistic over the window: sum the per-example (or "
        "per-token) losses and divide once by the window's count (num_items_in_batch)",
        "split",
    ),
    "attention_crosses_examples": _trainer(
        "packed or flattened rows let each example's tokens attend to the examples before it "
        "in the row: the model sees another context than the example alone",
        "a small error in every update that grows with more, shorter examples per row; the "
        "loss differs from the examples trained one by one",
        "give the attention the example boundaries (position_ids restarting at each example "
        "with an attention that reads them, or a block-diagonal mask), or pad instead of "
        "packing",
    ),
    "pad_predicts_target": _trainer(
        "with left padding the last pad position predicts each row's first real token, "
        "whose label is a target: the loss scores and counts a prediction made from "
        "padding that the example alone does not have",
        "updates slightly off and a target count larger than the examples hold, more with "
        "many short rows",
        "mask the label of each row's first real token (-100) when padding on the left, or "
        "pad on the right",
    ),
    "ranks_disagree": _trainer(
        "the data-parallel ranks hold different gradients after the sync: the model is not "
        "wrapped in DistributedDataParallel, or a copy of it is trained",
        "replicas drift apart: each rank trains its own model",
        "launch with torchrun so the model is wrapped in DistributedDataParallel (a Trainer "
        "does it), and train the wrapped model, not a copy",
    ),
    "labels_not_shifted": _loop(
        "the loss compares each position's logits with its own input token: the labels are "
        "not shifted",
        "a training loss that drops fast towards zero while the model learns nothing useful: "
        "each position is trained to repeat the token it already sees",
        "predict the next token: compare logits[:, :-1] with labels[:, 1:] (a Hugging Face "
        "model given labels= shifts them itself)",
    ),
    "labels_shifted_twice": _loop(
        "the labels are shifted before a model that shifts them again: each position is "
        "scored on the token two places ahead",
        "a loss that stays high: each position is trained to predict the token two places "
        "ahead, because the labels were shifted before a model that shifts them again",
        "shift once: either compare logits[:, :-1] with labels[:, 1:] yourself, or pass the "
        "unshifted labels= to a model that shifts them; never both",
    ),
    "lost_microbatches": _loop(
        "some microbatches (or rows) of the window never reach a backward pass before its "
        "optimizer.step()",
        "fewer examples reach the gradient than the loader delivers: the skipped microbatches "
        "(or rows) never train, and every update is taken from part of its window",
        "train on every microbatch of the window, every row of it, once: iterate over the "
        "whole list (no slice such as window[1:] or window[:-1], no pop while iterating, no "
        "loss outside the loop body, no zip(window[0::2], window[1::2]) that drops the last "
        "microbatch of an odd window)",
    ),
    "duplicated_microbatch": _loop(
        "a microbatch goes through forward and backward more than once in one window",
        "some examples weigh two (or more) times as much as the others in the update, and "
        "the result depends on which ones were repeated",
        "run each microbatch through forward and backward exactly once per window",
    ),
    "zero_grad_in_window": _loop(
        "the gradients are cleared between two backward passes of the same window, so the "
        "update holds only what came after the last clear",
        "accumulation with no effect: only the last microbatch's gradient reaches the update, "
        "as if A were 1",
        "clear the gradients once per window: before its first microbatch or right after "
        "optimizer.step(), never between two backward passes of the same window",
    ),
    "clip_per_microbatch": _loop(
        "the gradient is clipped after every backward pass, on partial sums of the window's "
        "gradient: the combined gradient is not what is clipped, and each later clip shrinks "
        "the earlier microbatches again",
        "later microbatches weigh more than earlier ones in every update (the first can "
        "nearly vanish), and the update depends on the order of the microbatches and on A",
        "clip once per window, after the last microbatch's backward pass (after unscale_ "
        "with a GradScaler), right before optimizer.step()",
    ),
    "no_update": _loop(
        "optimizer.step() is not called in the window",
        "accumulation with no effect: the weights and the loss do not move",
        "call optimizer.step() once per window, after the window's last backward pass",
    ),
    "step_per_microbatch": _loop(
        "optimizer.step() runs after every backward pass instead of once per window",
        "A small updates per window instead of one: the effective batch is the microbatch, "
        "the update count is A times too high, and later gradients are taken at moved weights",
        "call optimizer.step() (and zero_grad) once per window, after the last backward pass",
    ),
    "scheduler_per_microbatch": _loop(
        "scheduler.step() runs once per microbatch instead of once per update",
        "a shifted schedule: warmup and decay run A times too fast, counted in backward "
        "passes instead of updates",
        "call scheduler.step() once per update, right after optimizer.step()",
    ),
    "scheduler_before_optimizer": _loop(
        "scheduler.step() runs before the optimizer.step() it belongs to",
        "a schedule one update early: every update runs at the learning rate meant for the "
        "next one (warmup skips its first value, decay ends early); PyTorch warns "
        '"Detected call of `lr_scheduler.step()` before `optimizer.step()`"',
        "call scheduler.step() after optimizer.step(), once per update",
    ),
    "kept_references": _loop(
        "the loop keeps outputs, logits or loss tensors, with their autograd graphs, beyond "
        "their microbatch (in a list for logging, a running loss that is not detached)",
        "growing memory: live memory rises window after window until the run is out of memory",
        "keep no output, logits or loss tensor that holds a graph beyond its microbatch: to log "
        "the loss, add loss.detach() to a running tensor and read it as a Python float once "
        "per window (a .item() per microbatch makes the host wait for the device)",
    ),
    "window_modified_in_place": _loop(
        "the loop writes into the window's tensors (labels shifted in place, inputs edited) "
        "instead of into a copy",
        "data that changes each time it is read: the next epoch, a retried window or a "
        "resumed run trains on labels (or inputs) the loop already edited, e.g. shifted again",
        "never write into the window's tensors: shift or edit a copy (labels[:, 1:] is a "
        "view of the same memory; .clone() before editing)",
    ),
}


def reported_by(audit: str) -> tuple[str, ...]:
    """The names ``audit`` (one of :data:`AUDITS`) can report, in the table's order."""
    if audit not in AUDITS:
        raise ValueError(f"audit must be one of {AUDITS}, got {audit!r}")
    return tuple(name for name, mistake in MISTAKES.items() if audit in mistake.audits)


__all__ = ["AUDITS", "MISTAKES", "Mistake", "reported_by"]
