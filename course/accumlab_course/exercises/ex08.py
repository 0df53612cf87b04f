"""Exercises for notebook 08 (audit the job you run: a Trainer, its count, a callback).

- ``factor_predicted`` (predict first): the factor by which a Hugging Face ``Trainer``
  scales the gradient of GPT-2 as built from its config, on the notebook's window of 8
  examples with labels on every real token: the loss scores the targets after the shift
  (95), the Trainer divides by the labels it counted before the shift (103).
"""

from __future__ import annotations

from .predictions import number_prediction

#: The notebook's window: 8 short examples (103 real tokens), labels on every real token.
WINDOW_LABELS = 103
WINDOW_TARGETS = 95  # one fewer per row: nothing predicts a row's first token

factor_predicted = number_prediction(
    __name__,
    "factor_predicted",
    WINDOW_TARGETS / WINDOW_LABELS,
    what="the applied gradient divided by the full-batch one, a number near 1",
    mistakes={
        1.0: "what a count of the scored targets would give; this count holds more",
        WINDOW_LABELS / WINDOW_TARGETS: (
            "the inverse: a larger denominator makes every contribution, and the gradient, smaller"
        ),
        0.25: "1/A: the Trainer divides by its count only, never by A as well",
    },
    hints=(
        "The model divides its summed loss by num_items_in_batch; the full-batch gradient "
        "divides the same sum by the targets the loss scores.",
        "Each of the 8 rows has one label the loss never scores (its first: nothing predicts "
        "it), and the Trainer counted it: 103 counted, 103 - 8 scored.",
    ),
    reasoning=(
        "The loss sums the cross-entropy over the 95 targets after the shift and is divided "
        "by the Trainer's count, 103 (labels before the shift, every row's first label "
        "included); the full-batch gradient divides the same sum by 95. Every contribution, "
        "so the whole gradient, is scaled by 95 / 103."
    ),
)
