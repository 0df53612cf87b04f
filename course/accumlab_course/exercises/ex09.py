"""Exercises for notebook 09 (who divides by what: how each framework scales your loss).

Both are predictions, answered from the frameworks' rules the lesson measured, about jobs
it has not run yet:

- ``accelerate_divisor``: lesson 02's loss (each microbatch's summed loss divided by the
  window's targets) passed unchanged to ``accelerator.backward``: what each target of the
  notebook's first window is divided by.
- ``trainer_short_window``: the ``Trainer`` with a model whose ``forward`` takes no
  ``**kwargs``, on all the notebook's examples: what multiple of its microbatch's targets
  each target of the short last window is divided by.

The answers are the reasonings' (``solution()``); the module's constants are the notebook's
window, which the course's tests recount from the data.
"""

from __future__ import annotations

from .predictions import number_prediction

#: The notebook's window: its first 8 examples, every real token labelled.
WINDOW_TARGETS = 95  # targets after the shift
ACCUMULATION_STEPS = 4  # A, as the jobs are configured

accelerate_divisor = number_prediction(
    __name__,
    "accelerate_divisor",
    ACCUMULATION_STEPS * WINDOW_TARGETS,
    what="the number each target of the first window is divided by",
    mistakes={
        WINDOW_TARGETS: (
            "what the loss divides by; accelerator.backward divides what it is given by "
            "gradient_accumulation_steps, whatever the loss already did"
        ),
        WINDOW_TARGETS / ACCUMULATION_STEPS: (
            "a multiplication by A, what a loss must do to undo Accelerate's division; "
            "the loss here does not"
        ),
    },
    hints=(
        "Section 3: Accelerator.backward(loss) divides the loss by gradient_accumulation_steps "
        "before it calls backward, whatever the loss is.",
        "The loss already divides each target by the window's targets (section 1's loop); "
        "the division by A comes on top of it.",
    ),
    reasoning=(
        "The loss divides each microbatch's summed loss by the window's 95 targets, the right "
        "weight; Accelerator.backward then divides that loss by gradient_accumulation_steps, "
        "4, as it divides every loss it is given. Each target is divided by 4 × 95: the update "
        "is a quarter of the token mean's (the double division of lesson 07). Multiply the "
        "loss by accelerator.gradient_accumulation_steps, or call loss.backward() yourself."
    ),
)

trainer_short_window = number_prediction(
    __name__,
    "trainer_short_window",
    1.0,
    what="the divisor of each target of the short window, as a multiple of its microbatch's targets",
    mistakes={
        float(ACCUMULATION_STEPS): (
            "the configured A: Accelerate and Lightning divide a short window by it; the "
            "Trainer divides by current_gradient_accumulation_steps, the microbatches of "
            "this window"
        ),
        0.25: "the inverse: the divisor is a count of microbatches times the targets",
    },
    hints=(
        "Section 2: a loss not already scaled is divided by current_gradient_accumulation_steps.",
        "The Trainer sets current_gradient_accumulation_steps from the microbatches it fetched "
        "for this window, before the window's forward passes.",
    ),
    reasoning=(
        "The wrapper's forward takes no **kwargs, so the Trainer passes no count and divides "
        "the loss, its microbatch's mean, by current_gradient_accumulation_steps, which it "
        "sets to the number of microbatches it fetched for the window. The short window holds "
        "one: each of its targets is divided by its microbatch's targets times 1, the weight "
        "the window needs. Accelerate and Lightning divide the same window by the configured "
        "4, a quarter of its weight."
    ),
)
