"""Exercises of notebook 02 (token weighting).

- ``window_token_loss``: write ``window_token_loss(microbatch_logits, microbatch_labels)``
  that returns the window's token-mean next-token loss (a 0-d tensor): every supervised
  target of every microbatch weighted the same; ``None`` for a window without any target.
  A microbatch without targets may be kept or skipped: its logits' gradient is then zero
  or ``None``, and the checker counts ``None`` as zero.
- ``window_weighted_loss`` (transfer): the same window when every row carries a weight
  (a data source up- or down-weighted) and each of its targets counts that many times:
  ``sum(w_r × token loss) / sum(w_r × targets of row r)``; ``None`` when that count is 0.
- Predict first: ``second_contribution`` (loss sum 18 over a window of 8 targets),
  ``same_direction`` (which wrong loop keeps the gradient's direction) and
  ``better_on_short_answers`` (which trained model ends lower on short answers).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from accumlab.objectives import NextTokenLoss

from . import Exercise, grads_close
from .predictions import choice_prediction, number_prediction

IGNORE = -100
VOCAB = 11  # small, so the checker runs in milliseconds

WindowLoss = Callable[[Sequence[Tensor], Sequence[Tensor]], Tensor | None]


def reference_window_token_loss(
    microbatch_logits: Sequence[Tensor], microbatch_labels: Sequence[Tensor]
) -> Tensor | None:
    """The window's token mean: summed next-token cross-entropy / the window's targets.

    ``microbatch_logits[i]`` is (batch_i, seq_i, vocab) and ``microbatch_labels[i]`` is
    (batch_i, seq_i) with -100 on ignored positions; position t is scored against
    labels[:, t + 1]. Returns a 0-d tensor in nats per target, or None when the window
    has no target (nothing to learn: the loop skips its update).
    """
    total = sum(int((labels[:, 1:] != -100).sum()) for labels in microbatch_labels)
    if total == 0:
        return None
    loss_sum = sum(
        F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        for logits, labels in zip(microbatch_logits, microbatch_labels, strict=True)
    )
    return loss_sum / total


def _random_window(
    shapes: Sequence[tuple[int, int]], keep: Sequence[float], seed: int
) -> tuple[list[Tensor], list[Tensor]]:
    """Microbatches of the given (batch, seq) shapes; ``keep[i]`` is the share of label
    positions of microbatch i that stay supervised (0 makes it target-free)."""
    g = torch.Generator().manual_seed(seed)
    logits, labels = [], []
    for (b, t), p in zip(shapes, keep, strict=True):
        logits.append(torch.randn(b, t, VOCAB, generator=g))
        lab = torch.randint(0, VOCAB, (b, t), generator=g)
        lab[torch.rand(b, t, generator=g) >= p] = IGNORE
        labels.append(lab)
    return logits, labels


# Each case: microbatch shapes, supervised share per microbatch, seed. Uneven on purpose:
# different batch sizes, sequence lengths and target counts; the last case has a
# microbatch with no targets at all (a fully padded one), which must add nothing.
_CASES = (
    (((2, 9), (5, 4)), (0.9, 0.5), 1),
    (((1, 17), (3, 6), (4, 12)), (0.3, 1.0, 0.6), 2),
    (((3, 8), (2, 5), (6, 3)), (0.7, 0.0, 0.8), 3),
)

_OBJECTIVE = NextTokenLoss(ignore_index=IGNORE)


def _package_value(logits: Sequence[Tensor], labels: Sequence[Tensor]) -> Tensor:
    """The same number from the package's objective: sum of loss_sum / sum of count."""
    batches = [{"labels": lab} for lab in labels]
    total = sum(_OBJECTIVE.count(b) for b in batches)
    return sum(_OBJECTIVE.loss_sum(x, b) for x, b in zip(logits, batches, strict=True)) / total


def _mean_ce(logits: Tensor, labels: Tensor) -> float:
    return float(
        F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=IGNORE
        )
    )


def _diagnose(value: float, logits: list[Tensor], labels: list[Tensor]) -> str:
    """Name the usual mistake whose number the answer reproduces, if any."""
    means = [_mean_ce(x, y) for x, y in zip(logits, labels, strict=True)]
    if any(not math.isfinite(m) for m in means) and not math.isfinite(value):
        return (
            "a microbatch without targets made it NaN: its mean is 0/0. Sum the losses per "
            "microbatch and divide once, by the window's target count"
        )
    sums = [
        float(
            F.cross_entropy(
                x[:, :-1].reshape(-1, VOCAB), y[:, 1:].reshape(-1),
                ignore_index=IGNORE, reduction="sum",
            )
        )
        for x, y in zip(logits, labels, strict=True)
    ]
    positions = sum(y[:, 1:].numel() for y in labels)
    unshifted = sum(
        float(
            F.cross_entropy(
                x.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE, reduction="sum"
            )
        )
        for x, y in zip(logits, labels, strict=True)
    ) / max(1, sum(int((y != IGNORE).sum()) for y in labels))
    suspects = {
        "that is the average of the per-microbatch means: a target in a small microbatch "
        "counts more than one in a big microbatch": sum(means) / len(means),
        "you divided by every position, ignored ones (-100) included; divide by the "
        "supervised targets, labels[:, 1:] != -100": sum(sums) / positions,
        "you scored logits[:, t] against labels[:, t]; shift: logits[:, :-1] against "
        "labels[:, 1:]": unshifted,
        "you returned the window's sum without dividing by its target count": sum(sums),
    }
    for message, wrong in suspects.items():
        if math.isclose(value, wrong, rel_tol=1e-5, abs_tol=1e-7):
            return message
    return "it does not equal the window's summed token loss divided by its target count"


def _shown(value: float, expected: float) -> tuple[str, str]:
    """Both numbers with 4 significant digits, the most that float32 sums in another order
    leave unchanged (strict nbval compares the verdict); 7 when 4 would print them equal."""
    for digits in (4, 7):
        a, b = f"{value:.{digits}g}", f"{expected:.{digits}g}"
        if a != b:
            break
    return a, b


def _check_window_token_loss(answer: WindowLoss) -> str | None:
    if not callable(answer):
        return f"pass your function itself, got {type(answer).__name__}"
    for shapes, keep, seed in _CASES:
        logits, labels = _random_window(shapes, keep, seed)
        expected = _package_value(logits, labels)
        mine = [x.clone().requires_grad_(True) for x in logits]
        got = answer(mine, [y.clone() for y in labels])
        if (wrong := _not_one_number(got)) is not None:
            return wrong
        value = float(got.detach())
        if not math.isclose(value, float(expected), rel_tol=1e-5, abs_tol=1e-7):
            counts = [_OBJECTIVE.count({"labels": y}) for y in labels]
            shown, right = _shown(value, float(expected))
            return (
                f"on microbatches with {counts} targets you returned {shown}, the window's "
                f"token mean is {right}: {_diagnose(value, logits, labels)}"
            )
        wrong = _gradient_differs(got, mine, logits, reference_window_token_loss, labels)
        if wrong is not None:
            return wrong
    return _check_empty_window(answer)


def _not_one_number(got: object) -> str | None:
    """What is wrong with a returned loss that is no one-number tensor; None when it is one."""
    if not isinstance(got, Tensor):
        return f"return a tensor (so it can be backpropagated), got {type(got).__name__}"
    if got.numel() != 1:
        return f"return a single number (0-d tensor), got shape {tuple(got.shape)}"
    return None


def _gradient_differs(
    got: Tensor,
    mine: list[Tensor],
    logits: list[Tensor],
    reference: Callable[..., Tensor | None],
    *rest: Sequence[Tensor],
) -> str | None:
    """Backpropagate ``got``, a loss of the right value made from ``mine`` (the learner's
    copies of ``logits``), and ``reference(copies, *rest)`` made from fresh copies of
    ``logits``: what differs, or None when each microbatch's logits get the reference's
    gradient."""
    if not got.requires_grad:
        return "the result is detached from the logits; keep it a differentiable tensor"
    got.reshape(()).backward()
    theirs = [x.clone().requires_grad_(True) for x in logits]
    loss = reference(theirs, *rest)
    assert loss is not None  # the cases the checkers call this on all have targets
    loss.backward()
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if not grads_close(a, b):  # a skipped microbatch's None counts as zero
            return f"the value is right but the gradient of microbatch {i}'s logits is not"
    return None


def _check_empty_window(answer: WindowLoss) -> str | None:
    """A window whose microbatches hold no target at all must give None."""
    logits, labels = _random_window(((2, 5), (3, 4)), (0.0, 0.0), seed=9)
    try:
        got = answer(logits, labels)
    except ZeroDivisionError:
        return ("on a window without any target it raised ZeroDivisionError; check the count "
                "first and return None when it is 0 (the loop then skips the update)")
    if got is None:
        return None
    shown = f"{float(got):.4g}" if isinstance(got, Tensor) and got.numel() == 1 else repr(got)
    return (
        f"on a window without any target you returned {shown}; there is nothing to learn, so "
        "return None (the loop then skips the update) instead of a number that would be "
        "NaN or 0"
    )


window_token_loss = Exercise(
    name="window_token_loss",
    checker=_check_window_token_loss,
    hints=(
        "Count first: the window's targets are sum over microbatches of "
        "(labels[:, 1:] != -100).sum(). That is the one denominator.",
        "For each microbatch, score logits[:, :-1] against labels[:, 1:] with "
        "F.cross_entropy(..., ignore_index=-100, reduction='sum'), so ignored positions "
        "add nothing and a microbatch without targets adds 0.",
        "Add the per-microbatch sums and divide once by the window's target count; never "
        "average per-microbatch means.",
    ),
    reference=inspect.getsource(reference_window_token_loss),
)


# --- window_weighted_loss (transfer): every target of a row counts the row's weight ------------

WeightedLoss = Callable[[Sequence[Tensor], Sequence[Tensor], Sequence[Tensor]], Tensor | None]


def reference_window_weighted_loss(
    microbatch_logits: Sequence[Tensor],
    microbatch_labels: Sequence[Tensor],
    microbatch_weights: Sequence[Tensor],
) -> Tensor | None:
    """The window's weighted token mean: every target of row r counts ``weights[r]``
    times (a data source up- or down-weighted), so the loss is sum(w_r × token loss)
    over the window's targets divided by sum(w_r × targets of row r). A 0-d tensor, or
    None when that weighted count is 0 (nothing to learn)."""
    denominator = sum(
        float((weights * (labels[:, 1:] != -100).sum(dim=1)).sum())
        for labels, weights in zip(microbatch_labels, microbatch_weights, strict=True)
    )
    if denominator == 0:
        return None
    total = torch.zeros(())
    for logits, labels, weights in zip(
        microbatch_logits, microbatch_labels, microbatch_weights, strict=True
    ):
        targets = labels[:, 1:]
        token_loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1),
            ignore_index=-100, reduction="none",
        ).view(targets.shape)  # 0 at ignored positions
        total = total + (weights[:, None] * token_loss).sum()
    return total / denominator


def _weighted_case(seed: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Uneven microbatches with one weight per row; one row of weight 0, one row without
    targets, and in the third case a microbatch without any target."""
    shapes, keep = (
        (((2, 9), (5, 4)), (0.9, 0.5)),
        (((1, 17), (3, 6), (4, 12)), (0.3, 1.0, 0.6)),
        (((3, 8), (2, 5), (6, 3)), (0.7, 0.0, 0.8)),
    )[seed % 3]
    logits, labels = _random_window(shapes, keep, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    weights = [torch.rand(y.shape[0], generator=g) * 3 for y in labels]
    weights[-1][0] = 0.0  # a row that does not count at all
    labels[0][0] = IGNORE  # a row without targets
    return logits, labels, weights


def _token_losses(x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(
        x[:, :-1].reshape(-1, VOCAB), y[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="none"
    ).view(y[:, 1:].shape)


def _diagnose_weighted(
    value: float, logits: list[Tensor], labels: list[Tensor], weights: list[Tensor]
) -> str:
    parts = list(zip(logits, labels, weights, strict=True))
    sums = [float((w[:, None] * _token_losses(x, y)).sum()) for x, y, w in parts]
    counts = [int((y[:, 1:] != IGNORE).sum()) for _, y, _ in parts]
    weighted = [float((w * (y[:, 1:] != IGNORE).sum(dim=1)).sum()) for _, y, w in parts]
    means = [s / n for s, n in zip(sums, weighted, strict=True) if n > 0]
    suspects = {
        "you divided by the plain target count; every target of row r counts w_r times in "
        "the denominator too: divide by sum(w_r × targets of row r)": sum(sums) / sum(counts),
        "you divided by the sum of the row weights: a row's weight counts once per target "
        "of that row": sum(sums) / sum(float(w.sum()) for _, _, w in parts),
        "the weights were left out: that is the plain token mean":
            float(reference_window_token_loss(logits, labels)),
        "that is the average of the microbatches' weighted means: the average of averages "
        "again; divide the window's weighted sum once, by its weighted count":
            sum(means) / len(means),
        "you returned the weighted sum without dividing": sum(sums),
    }
    for message, wrong in suspects.items():
        if math.isclose(value, wrong, rel_tol=1e-5, abs_tol=1e-7):
            return message
    return "it does not equal sum(w_r × token loss) / sum(w_r × targets of row r) over the window"


def _check_window_weighted_loss(answer: WeightedLoss) -> str | None:
    if not callable(answer):
        return f"pass your function itself, got {type(answer).__name__}"
    for seed in (32, 30, 31):  # the window with a microbatch without targets first
        logits, labels, weights = _weighted_case(seed)
        expected = reference_window_weighted_loss(logits, labels, weights)
        assert expected is not None
        mine = [x.clone().requires_grad_(True) for x in logits]
        got = answer(mine, [y.clone() for y in labels], [w.clone() for w in weights])
        if (wrong := _not_one_number(got)) is not None:
            return wrong
        value = float(got.detach())
        counts = [_OBJECTIVE.count({"labels": y}) for y in labels]
        if not math.isfinite(value):
            return (f"on microbatches with {counts} targets you returned {value}: a microbatch "
                    "without targets has the mean 0/0; sum, then divide once for the window")
        if not math.isclose(value, float(expected), rel_tol=1e-5, abs_tol=1e-7):
            shown, right = _shown(value, float(expected))
            return (
                f"on microbatches with {counts} targets you returned {shown}, the window's "
                f"weighted token mean is {right}: {_diagnose_weighted(value, logits, labels, weights)}"
            )
        wrong = _gradient_differs(got, mine, logits, reference_window_weighted_loss, labels, weights)
        if wrong is not None:
            return wrong
    # a window with targets only in rows of weight 0: nothing to learn
    logits, labels, weights = _weighted_case(30)
    zero = [torch.zeros_like(w) for w in weights]
    try:
        got = answer(logits, labels, zero)
    except ZeroDivisionError:
        return ("on a window whose weights are all 0 it raised ZeroDivisionError; check the "
                "weighted count first and return None when it is 0")
    if got is not None:
        shown = f"{float(got):.4g}" if isinstance(got, Tensor) and got.numel() == 1 else repr(got)
        return (f"on a window whose weights are all 0 you returned {shown}; nothing counts, so "
                "return None (the loop then skips the update)")
    return None


window_weighted_loss = Exercise(
    name="window_weighted_loss",
    checker=_check_window_weighted_loss,
    hints=(
        "The full batch's loss: sum over all targets of w_row × loss, divided by the same sum "
        "with 1 in place of the loss. That denominator is known before any forward.",
        "Per microbatch: token losses with reduction='none' (0 where ignored), shape "
        "(batch, seq - 1); multiply by weights[:, None] and sum.",
        "Denominator: sum over microbatches of (weights * (labels[:, 1:] != -100).sum(dim=1))"
        ".sum(); return None when it is 0, else the weighted sum over it.",
    ),
    reference=inspect.getsource(reference_window_weighted_loss),
)


# --- predict first ------------------------------------------------------------------------------

#: Section 2's second microbatch: loss sum 18 (6 targets) in a window of 2 + 6 = 8 targets.
SECOND_CONTRIBUTION = 18 / 8

second_contribution = number_prediction(
    __name__,
    "second_contribution",
    SECOND_CONTRIBUTION,
    what="what the microbatch with loss sum 18 adds to a window of 8 targets",
    mistakes={
        3: "18 / 6, that microbatch's own mean: with one denominator for the window, each "
        "microbatch divides its sum by the window's 8 targets",
        1.5: "its mean 3 divided by A = 2, the average of averages",
        18: "the undivided loss sum",
        2.5: "the window's loss, both microbatches together",
    },
    hints=("Each microbatch backpropagates its loss sum divided by the window's target count.",),
    reasoning="18 / 8: the window has 2 + 6 = 8 targets, the same denominator for both "
    "microbatches (the other adds 2 / 8 = 0.25; together 20 / 8 = 2.5).",
)

same_direction = choice_prediction(
    __name__,
    "same_direction",
    "positions counted",
    choices=("average of averages", "positions counted", "both", "neither"),
    mistakes={
        "average of averages": "it weights a target by 1 / (A × its microbatch's count), "
        "different per microbatch, so the direction changes",
        "both": "only one of them weights every target the same",
        "neither": "one of them multiplies every target's weight by the same factor",
    },
    hints=(
        "A gradient keeps its direction when every target's weight is multiplied by the same "
        "factor.",
    ),
    reasoning="Dividing by all positions weights every target 1 / positions instead of "
    "1 / targets: the same factor for all, so the gradient only shrinks. The average of "
    "averages weights targets by 1 / (A × count of their microbatch): the direction moves.",
)

better_on_short_answers = choice_prediction(
    __name__,
    "better_on_short_answers",
    "average of averages",
    choices=("token mean", "average of averages"),
    mistakes={
        "token mean": "it wins on the held-out batch and the long answers, but the average of "
        "averages gives the short answers' few targets half of every update",
    },
    hints=("Which loop gives the 8 short-answer examples of every window more weight?",),
    reasoning="The average of averages gives each microbatch half the window's weight: the "
    "22 short-answer targets get as much as the ~280 long-answer ones, so that model fits "
    "short answers better and everything else worse.",
)

__all__ = [
    "better_on_short_answers",
    "reference_window_weighted_loss",
    "reference_window_token_loss",
    "same_direction",
    "second_contribution",
    "window_weighted_loss",
    "window_token_loss",
]
