"""The audit's vocabulary: the name of each mistake it can report, the symptom a user
sees in a real run and the fix, and what the audit does not check."""

from __future__ import annotations

#: Every name ``AuditReport.mistakes`` can hold, in the order they are reported.
MISTAKES: tuple[str, ...] = (
    "double_division",
    "average_of_averages",
    "ignored_tokens_counted",
    "count_before_shift",
    "labels_not_shifted",
    "labels_shifted_twice",
    "lost_microbatches",
    "duplicated_microbatch",
    "zero_grad_in_window",
    "no_update",
    "step_per_microbatch",
    "scheduler_per_microbatch",
    "scheduler_before_optimizer",
    "kept_references",
    "window_modified_in_place",
)

#: For each mistake: the symptom a user sees in a real run, and the fix.
ADVICE: dict[str, tuple[str, str]] = {
    "double_division": (
        "an abnormally small loss and updates A times too small (with SGD the run looks like "
        "one with a learning rate A times lower; Adam's normalization mostly hides the scale)",
        "divide each microbatch's loss sum once, by the window's target count; no extra / A "
        "(and none on top of a framework that already normalizes)",
    ),
    "average_of_averages": (
        "a result that depends on how the examples are split into microbatches: a target in "
        "a short microbatch weighs more than one in a long microbatch",
        "sum the token losses (reduction='sum') and divide by the target count of the whole "
        "window, counted before the forward passes; never average the microbatch means",
    ),
    "ignored_tokens_counted": (
        "a result that depends on padding and prompt length, and a loss that looks too small: "
        "the denominator counts positions that have no target",
        "count only supervised targets after the shift: (labels[:, 1:] != -100).sum()",
    ),
    "count_before_shift": (
        "updates a little too small, by targets / (targets + rows without a prompt): the count "
        "is taken before the shift, so each row whose first label is a target adds one that "
        "no prediction scores (the shortfall grows with more, shorter rows per window)",
        "count the targets after the shift, the positions the loss scores: "
        "(labels[:, 1:] != -100).sum(), also for num_items_in_batch when the model shifts "
        "the labels itself",
    ),
    "labels_not_shifted": (
        "a training loss that drops fast towards zero while the model learns nothing useful: "
        "each position is trained to repeat the token it already sees",
        "predict the next token: compare logits[:, :-1] with labels[:, 1:] (a Hugging Face "
        "model given labels= shifts them itself)",
    ),
    "labels_shifted_twice": (
        "a loss that stays high: each position is trained to predict the token two places "
        "ahead, because the labels were shifted before a model that shifts them again",
        "shift once: either compare logits[:, :-1] with labels[:, 1:] yourself, or pass the "
        "unshifted labels= to a model that shifts them; never both",
    ),
    "lost_microbatches": (
        "fewer examples reach the gradient than the loader delivers: the skipped microbatches "
        "(or rows) never train, and every update is taken from part of its window",
        "train on every microbatch of the window, every row of it, once: iterate over the "
        "whole list (no slice such as window[1:] or window[:-1], no pop while iterating, no "
        "loss outside the loop body, no zip(window[0::2], window[1::2]) that drops the last "
        "microbatch of an odd window)",
    ),
    "duplicated_microbatch": (
        "some examples weigh two (or more) times as much as the others in the update, and "
        "the result depends on which ones were repeated",
        "run each microbatch through forward and backward exactly once per window",
    ),
    "zero_grad_in_window": (
        "accumulation with no effect: only the last microbatch's gradient reaches the update, "
        "as if A were 1",
        "clear the gradients once per window: before its first microbatch or right after "
        "optimizer.step(), never between two backward passes of the same window",
    ),
    "no_update": (
        "accumulation with no effect: the weights and the loss do not move",
        "call optimizer.step() once per window, after the window's last backward pass",
    ),
    "step_per_microbatch": (
        "A small updates per window instead of one: the effective batch is the microbatch, "
        "the update count is A times too high, and later gradients are taken at moved weights",
        "call optimizer.step() (and zero_grad) once per window, after the last backward pass",
    ),
    "scheduler_per_microbatch": (
        "a shifted schedule: warmup and decay run A times too fast, counted in backward "
        "passes instead of updates",
        "call scheduler.step() once per update, right after optimizer.step()",
    ),
    "scheduler_before_optimizer": (
        "a schedule one update early: every update runs at the learning rate meant for the "
        "next one (warmup skips its first value, decay ends early); PyTorch warns "
        '"Detected call of `lr_scheduler.step()` before `optimizer.step()`"',
        "call scheduler.step() after optimizer.step(), once per update",
    ),
    "kept_references": (
        "growing memory: live memory rises window after window until the run is out of memory",
        "keep no output, logits or loss tensor that holds a graph beyond its microbatch: to log "
        "the loss, add loss.detach() to a running tensor and read it as a Python float once "
        "per window (a .item() per microbatch makes the host wait for the device)",
    ),
    "window_modified_in_place": (
        "data that changes each time it is read: the next epoch, a retried window or a "
        "resumed run trains on labels (or inputs) the loop already edited, e.g. shifted again",
        "never write into the window's tensors: shift or edit a copy (labels[:, 1:] is a "
        "view of the same memory; .clone() before editing)",
    ),
}

#: What the audit does not check, said in every report.
NOT_CHECKED = (
    "Not checked by the audit: non-finite gradients and loss scaling, mixed precision, "
    "clipping, data-parallel averaging and no_sync, and your own model, data and optimizer "
    "(it runs the loop on its float64 model, SGD and controlled set)."
)
