"""Exercises for notebook 01 (the single-device loop).

- ``accumulate_from_means``: ``accumulate_from_means(model, window, mean_loss, count) ->
  None``. ``window`` is a list of microbatches (mappings of tensors); ``mean_loss(model,
  microbatch)`` runs the model and returns the microbatch's *mean* loss per unit as a 0-d
  tensor (what a Hugging Face model's ``outputs.loss`` is), NaN when the microbatch has no
  unit; ``count(microbatch)`` is its number of units (an int). After the call every
  parameter's ``.grad`` holds the gradient of the window's mean loss per unit, as one
  full-batch backward pass would give; a microbatch without units adds nothing, and a window
  without any unit leaves ``.grad`` untouched. The caller clears ``.grad`` before and steps
  after. The text built the loop from loss *sums*; this one starts from means.
- ``weighted_window_update`` (a whole window, transfer): ``weighted_window_update(model,
  window, optimizer, scheduler) -> float | None`` for a window whose examples carry weights
  (``mb["weight"]``): one update of the weighted mean cross-entropy, ``sum(w · ce) /
  sum(w)`` over the whole window; ``.grad`` may hold a stale gradient when it is called
  and must be clear after; the scheduler advanced once; it returns the window's weighted
  mean loss, or ``None`` when the window's weights add up to 0 (no step of the optimizer
  or the scheduler, the weights unchanged; the stale ``.grad`` may stay or be cleared).
  A microbatch holds ``"x"`` (m × 6 features), ``"labels"`` (m classes), ``"weight"``.
- Predict first: ``undivided_gradient`` (the one-weight example without the division by
  ``A``) and ``adamw_ratio`` (AdamW's update without / with the division by ``A``).

The checkers run the answer on fresh models and data, compare with the full batch, and name
the usual mistakes: no division, the average of the means, a microbatch without units,
``zero_grad`` inside the loop, a step or a scheduler step per microbatch, stale gradients.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from accumlab.checks import compare, full_batch_gradient, gradients, split_batch
from accumlab.loop import default_forward
from accumlab.objectives import ExampleLoss, NextTokenLoss, Objective

from ..data import VOCAB_SIZE, Example, collate
from ..models import MLP, TinyGPT
from . import Exercise, fills_grad_only
from .predictions import number_prediction

#: Relative tolerance of the checkers: float32 accumulation order changes the last bits only.
RTOL = 1e-4

MeanLoss = Callable[[nn.Module, Mapping[str, Tensor]], Tensor]
Count = Callable[[Mapping[str, Tensor]], int]


def reference_accumulate_from_means(
    model: nn.Module,
    window: Sequence[Mapping[str, Tensor]],
    mean_loss: MeanLoss,
    count: Count,
) -> None:
    """Backpropagate mean × count(microbatch) / count(window): the microbatch's loss sum
    over the window's count. A microbatch without units (mean NaN) is skipped."""
    counts = [count(mb) for mb in window]  # the window's count, before any forward
    total = sum(counts)
    for microbatch, n in zip(window, counts, strict=True):
        if n == 0:
            continue  # nothing to learn from; its mean is 0/0
        (mean_loss(model, microbatch) * n / total).backward()  # adds into .grad


def _mlp_case(seed: int, sizes: list[int], loss: str) -> tuple[nn.Module, dict[str, Tensor], Objective]:
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(n, 6, generator=g)
    if loss == "mse":
        labels: Tensor = torch.randn(n, 3, generator=g)
    else:
        labels = torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(seed)
    return MLP(6, 10, 3), {"x": x, "labels": labels}, ExampleLoss(loss)


def _gpt_case(seed: int, sizes: list[int]) -> tuple[nn.Module, dict[str, Tensor], Objective]:
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(sum(sizes)):
        length = int(torch.randint(4, 14, (), generator=g))
        ids = torch.randint(2, VOCAB_SIZE, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, length - 1, (), generator=g))
        examples.append(Example(id=i, input_ids=ids, prompt_len=prompt))
    torch.manual_seed(seed)
    model = TinyGPT(VOCAB_SIZE, block_size=16, n_layer=1, n_head=2, n_embd=16)
    return model, collate(examples), NextTokenLoss()



Case = tuple[nn.Module, dict[str, Tensor], Objective]


def _gpt_case_with_empty(seed: int, sizes: list[int], empty: int) -> Case:
    """The GPT case with every label of microbatch ``empty`` set to -100 (no targets)."""
    model, batch, objective = _gpt_case(seed, sizes)
    start = sum(sizes[:empty])
    batch["labels"][start : start + sizes[empty]] = -100
    return model, batch, objective


def _cases() -> list[tuple[str, list[int], Callable[[], Case]]]:
    return [
        ("MLP, cross-entropy per example", [3, 1, 3], lambda: _mlp_case(11, [3, 1, 3], "cross_entropy")),
        ("MLP, mean squared error per example", [2, 5], lambda: _mlp_case(12, [2, 5], "mse")),
        ("tiny GPT, masked next-token targets, microbatch 2 without any target", [1, 2, 1, 2],
         lambda: _gpt_case_with_empty(13, [1, 2, 1, 2], empty=2)),
    ]


def _flat(grads: Mapping[str, Tensor]) -> Tensor:
    return torch.cat([g.reshape(-1).double() for g in grads.values()])


def _microbatch_gradients(
    model: nn.Module, window: Sequence[Mapping[str, Tensor]], objective: Objective
) -> list[Tensor]:
    """The gradient of each microbatch's loss *sum* (no division), flattened."""
    parts = []
    for mb in window:
        model.zero_grad(set_to_none=True)
        objective.loss_sum(default_forward(model, mb), mb).backward()
        parts.append(_flat(gradients(model)))
    model.zero_grad(set_to_none=True)
    return parts


def _close(a: Tensor, b: Tensor) -> bool:
    scale = float(b.abs().max())
    return scale > 0 and float((a - b).abs().max()) <= RTOL * scale


def _diagnose(got: Tensor, parts: list[Tensor], counts: list[int]) -> str | None:
    """Name the mistake whose gradient ``got`` reproduces, if it is a known one. ``parts``
    are the gradients of each microbatch's loss sum; microbatches without units are left
    out of every candidate (their mean is NaN, caught before)."""
    kept = [(p, n) for p, n in zip(parts, counts, strict=True) if n > 0]
    total, a = sum(counts), len(kept)
    known = [
        (sum(p / (n * a) for p, n in kept),
         "it is the average of the microbatch means: that weights a unit in a small microbatch "
         "more than one in a big microbatch; weight each mean by its count over the window's count"),
        (sum(p / (n * len(counts)) for p, n in kept),
         "it is the average of the microbatch means (divided by A): weight each mean by its "
         "count over the window's count"),
        (sum(p / n for p, n in kept),
         "it is the sum of the microbatch means: weight each mean by its count over the "
         "window's count"),
        (sum(p for p, _ in kept), f"it is {total} times the full-batch gradient: mean × count is "
         f"the microbatch's loss sum; divide it by the window's count ({total})"),
        (sum(p / (n * total) for p, n in kept),
         "each mean was divided by the window's count: a mean is already divided by its own "
         "count; multiply it back (mean × count = loss sum) before dividing by the window's"),
    ]
    last = kept[-1]
    known += [
        (last[0] * scale, "only the last microbatch's gradient survived: clear gradients once "
         "before the window (the caller does), never inside the microbatch loop")
        for scale in (1.0 / total, 1.0 / last[1], 1.0 / (last[1] * a), 1.0)
    ]
    for expected, message in known:
        if _close(got, expected):
            return message
    return None


def _mean_loss_of(objective: Objective) -> MeanLoss:
    def mean_loss(model: nn.Module, mb: Mapping[str, Tensor]) -> Tensor:
        # like a Hugging Face model's outputs.loss: NaN (0/0) for a microbatch without units
        return objective.loss_sum(default_forward(model, mb), mb) / objective.count(mb)

    return mean_loss


def check_accumulate_from_means(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` fills ``.grad`` with the full-batch gradient on every case
    (relative error at most :data:`RTOL`) and leaves ``.grad`` untouched for a window without
    units, else what went wrong, naming a known mistake."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    with torch.random.fork_rng(devices=[]):  # leave the notebook's random state alone
        for name, sizes, build in _cases():
            model, batch, objective = build()
            window = split_batch(batch, sizes)
            reference = full_batch_gradient(model, batch, objective)
            parts = _microbatch_gradients(model, window, objective)
            counts = [objective.count(mb) for mb in window]
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

            model.zero_grad(set_to_none=True)
            answer(model, window, _mean_loss_of(objective), objective.count)
            got = gradients(model)
            where = f"on {name}, microbatches of {sizes} examples"
            if counts != sizes:
                where += f" ({counts} {objective.unit}s)"
            problem = fills_grad_only(model, weights, where)
            if problem is not None:
                return problem
            flat = _flat(got)
            if not bool(torch.isfinite(flat).all()):
                return (f"{where}: .grad holds NaN: a microbatch without {objective.unit}s has "
                        "the mean 0/0; it has nothing to add, so skip it (or use its loss sum)")
            if compare(reference, got).ok(RTOL):
                continue
            if float(flat.abs().max()) == 0.0:
                return f"{where}: the gradient is zero; call .backward() on each microbatch's loss"
            mistake = _diagnose(flat, parts, counts)
            if mistake is not None:
                return f"{where}: {mistake}"
            return (
                f"{where}: the gradient differs from the full batch "
                f"(max relative error {compare(reference, got).max_rel_error:.3g} > {RTOL:g})"
            )
        # a window without any target: nothing to learn, .grad stays as the caller left it
        model, batch, objective = _gpt_case(14, [2, 1])
        batch["labels"][:] = -100
        model.zero_grad(set_to_none=True)
        try:
            answer(model, split_batch(batch, [2, 1]), _mean_loss_of(objective), objective.count)
        except ZeroDivisionError:
            return ("on a tiny-GPT window without any target it raised ZeroDivisionError: count "
                    "the window first; with a count of 0 there is nothing to learn, so return "
                    "before dividing and leave .grad alone")
        if any(p.grad is not None for p in model.parameters()):
            return ("on a tiny-GPT window without any target: .grad was written (a NaN or zero "
                    "gradient); a window without units has nothing to learn, leave .grad alone")
    return None


accumulate_from_means = Exercise(
    name="accumulate_from_means",
    checker=check_accumulate_from_means,
    hints=(
        "A mean is a loss sum divided by its own count: mean × count(mb) gives the sum back.",
        "Count the window first: total = sum(count(mb) for mb in window). Each microbatch "
        "then backpropagates mean_loss(model, mb) * count(mb) / total.",
        "A microbatch with count 0 has a NaN mean and nothing to add: skip it before the "
        "forward. backward() adds into .grad; do not clear gradients or step here.",
    ),
    reference=inspect.getsource(reference_accumulate_from_means),
)


# --- weighted_window_update: a whole window, with per-example weights ------------------------


def reference_weighted_window_update(
    model: nn.Module,
    window: Sequence[Mapping[str, Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
) -> float | None:
    """One update from a window whose examples carry weights: every microbatch
    backpropagates sum(w · ce) / (the window's total weight); one step, then clean .grad
    and one scheduler step. Returns the window's weighted mean loss, or None when the
    window's weights add up to 0 (then nothing changes)."""
    total = sum(float(mb["weight"].sum()) for mb in window)  # known before any forward
    if total == 0:
        return None
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(())
    for mb in window:
        ce = nn.functional.cross_entropy(model(mb["x"]), mb["labels"], reduction="none")
        part = (mb["weight"] * ce).sum()
        (part / total).backward()
        loss_sum += part.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return float(loss_sum) / total


class _CountingSGD(torch.optim.SGD):
    """SGD that counts its ``step`` calls."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.calls = 0

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        return super().step(closure)


def _weighted_window(seed: int, sizes: Sequence[int], zero: Sequence[int] = ()) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    window = []
    for i, m in enumerate(sizes):
        weight = torch.rand(m, generator=g) * 2
        if i in zero:
            weight = torch.zeros(m)
        window.append({"x": torch.randn(m, 6, generator=g),
                       "labels": torch.randint(0, 3, (m,), generator=g), "weight": weight})
    return window


def _weighted_gradient(model: nn.Module, window: Sequence[Mapping[str, Tensor]], kind: str) -> Tensor:
    """The flat gradient a weighting rule gives, from zeroed .grad (model left clean)."""
    model.zero_grad(set_to_none=True)
    weights = torch.cat([mb["weight"] for mb in window])
    n = int(weights.numel())
    for mb in window:
        ce = nn.functional.cross_entropy(model(mb["x"]), mb["labels"], reduction="none")
        w, m = mb["weight"], int(mb["weight"].numel())
        loss = {
            "right": (w * ce).sum() / weights.sum(),
            "unweighted": ce.sum() / n,
            "by examples": (w * ce).sum() / n,
            "no division": (w * ce).sum(),
            "average of weighted means": (w * ce).sum() / w.sum().clamp(min=1e-30) / len(window),
            "per-microbatch mean": (w * ce).sum() / m / len(window),
        }[kind]
        loss.backward()
    flat = _flat(gradients(model))
    model.zero_grad(set_to_none=True)
    return flat


_WEIGHT_MISTAKES = {
    "unweighted": "the weights were left out: each example's loss counts w times",
    "by examples": "you divided by the number of examples; the weighted mean divides the "
    "weighted sum by the window's total weight",
    "no division": "the weighted sum was not divided by the window's total weight",
    "average of weighted means": "that is the average of the microbatches' weighted means: "
    "divide every microbatch's weighted sum by the whole window's total weight",
    "per-microbatch mean": "each microbatch divided by its own size and by A: divide every "
    "weighted sum by the window's total weight",
}


def check_weighted_window_update(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` makes the full-batch weighted-mean update (SGD, lr 0.5) on two
    windows, returns the window's weighted mean loss, steps the optimizer and the scheduler
    once, leaves ``.grad`` clean, and does nothing for a window of zero weight."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    lr = 0.5
    with torch.random.fork_rng(devices=[]):
        for seed, sizes, zero in ((21, [3, 1, 4], ()), (22, [2, 5, 2], (1,))):
            torch.manual_seed(seed)
            model = MLP(6, 10, 3)
            window = _weighted_window(seed, sizes, zero)
            where = f"on a window of {sizes} examples" + (
                f" (microbatch {zero[0]} has weight 0)" if zero else "")
            expected = {k: _weighted_gradient(model, window, k) for k in ("right", *_WEIGHT_MISTAKES)}
            stale = _weighted_gradient(model, _weighted_window(seed + 100, [4]), "right")
            before = _flat({k: v.detach() for k, v in model.named_parameters()}).clone()
            weights = torch.cat([mb["weight"] for mb in window])
            ce = torch.cat([nn.functional.cross_entropy(model(mb["x"]), mb["labels"], reduction="none")
                            for mb in window]).detach()
            expected_loss = float((weights * ce).sum() / weights.sum())
            offset = 0  # a stale gradient from an earlier window, as a real loop leaves it
            for p in model.parameters():
                k = p.numel()
                p.grad = stale[offset : offset + k].reshape(p.shape).float().clone()
                offset += k

            optimizer = _CountingSGD(model.parameters(), lr=lr)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0 / (u + 1))
            got_loss = answer(model, window, optimizer, scheduler)
            if optimizer.calls == 0:
                return f"{where}: optimizer.step() was never called; step once, after the window"
            if optimizer.calls > 1:
                return (f"{where}: optimizer.step() ran {optimizer.calls} times: that is an update "
                        "per microbatch; step once, at the window boundary")
            if scheduler.last_epoch != 1:
                return (f"{where}: the scheduler advanced {scheduler.last_epoch} times; it counts "
                        "updates, so step it once, after optimizer.step()")
            if any(p.grad is not None and bool(p.grad.any()) for p in model.parameters()):
                return (f"{where}: gradients were left in .grad after the update; clear them "
                        "(zero_grad) so nothing leaks into the next window")
            after = _flat({k: v.detach() for k, v in model.named_parameters()})
            gradient = (before - after) / lr  # SGD: after = before - lr × gradient
            if not bool(torch.isfinite(gradient).all()):
                return f"{where}: the weights became NaN"
            if not _close(gradient, expected["right"]):
                if _close(gradient, expected["right"] + stale):
                    return (f"{where}: the gradient left in .grad before the window was added to "
                            "the update; clear .grad before the first microbatch")
                for kind, message in _WEIGHT_MISTAKES.items():
                    if _close(gradient, expected[kind]):
                        return f"{where}: {message}"
                return f"{where}: the update differs from the full batch's weighted-mean update"
            if isinstance(got_loss, bool) or not isinstance(got_loss, (int, float)):
                return (f"{where}: return the window's weighted mean loss as a float, got "
                        f"{type(got_loss).__name__}")
            if not math.isclose(got_loss, expected_loss, rel_tol=1e-4):
                return (f"{where}: returned loss {got_loss:.4g}, the window's weighted mean loss "
                        f"is {expected_loss:.4g}")
        # a window whose weights add up to 0: nothing to learn
        torch.manual_seed(23)
        model = MLP(6, 10, 3)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():  # a stale gradient: clearing it or not are both fine
            p.grad = torch.ones_like(p)
        optimizer = _CountingSGD(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0 / (u + 1))
        got_loss = answer(model, _weighted_window(24, [2, 3], zero=(0, 1)), optimizer, scheduler)
        where = "on a window whose weights are all 0"
        if optimizer.calls or scheduler.last_epoch:
            return f"{where}: it stepped; a window with nothing to learn makes no update"
        if any(not torch.equal(state[k], v) for k, v in model.state_dict().items()):
            return f"{where}: the weights changed"
        if got_loss is not None:
            return f"{where}: returned {got_loss!r}; return None (no loss to report)"
        if any(p.grad is not None and not torch.equal(p.grad, torch.ones_like(p))
               and bool(p.grad.any()) for p in model.parameters()):
            return (f"{where}: .grad was written; there is nothing to backpropagate (leave "
                    "the stale gradient or clear it)")
    return None


weighted_window_update = Exercise(
    name="weighted_window_update",
    checker=check_weighted_window_update,
    hints=(
        "The full batch's loss is sum(w · ce) / sum(w) over the whole window: the window's "
        "denominator is its total weight, known before any forward.",
        "Per microbatch: ce = F.cross_entropy(model(mb['x']), mb['labels'], reduction='none'), "
        "then backward of (mb['weight'] * ce).sum() / total. Keep part.detach() for the loss.",
        "Around the loop: return None if total == 0; zero_grad before, one optimizer.step(), "
        "zero_grad after, scheduler.step() once.",
    ),
    reference=inspect.getsource(reference_weighted_window_update),
)


# --- predict first ----------------------------------------------------------------------------

#: The one-weight example: microbatch means 2, -1, 3, 4, each backpropagated undivided.
UNDIVIDED_GRADIENT = 2.0 + (-1.0) + 3.0 + 4.0

undivided_gradient = number_prediction(
    __name__,
    "undivided_gradient",
    UNDIVIDED_GRADIENT,
    what="the accumulated gradient of w, means 2, -1, 3, 4, no division by A",
    mistakes={
        2: "the full batch's gradient, which the division by A = 4 gives; without it the four "
        "means add up",
        0.5: "the first microbatch's contribution with the division (2 / 4)",
    },
    hints=("backward() adds into .grad; each microbatch adds the mean of its values.",),
    reasoning="backward adds: 2 + (-1) + 3 + 4. Divided by A = 4 each would add 0.50, -0.25, "
    "0.75 and 1.00, which sum to 2.",
)

#: AdamW's first update from a gradient scaled by a constant A = 3 (ratio of update norms);
#: notebook 01 measures 1.0000 and asserts it within 1e-3.
ADAMW_RATIO = 1.0

adamw_ratio = number_prediction(
    __name__,
    "adamw_ratio",
    ADAMW_RATIO,
    what="AdamW's update without / with the division by A = 3",
    rel_tol=1e-2,
    mistakes={
        3: "what SGD does (lr × gradient); AdamW divides each gradient entry by the root of its "
        "running mean square, so a constant factor cancels",
        1 / 3: "upside down; and AdamW's constant factor cancels anyway",
    },
    hints=(
        "AdamW's first update of an entry is about lr × g / sqrt(g²) (up to eps): what happens "
        "to it when g is multiplied by 3?",
    ),
    reasoning="m and sqrt(v) both scale by A, so m / (sqrt(v) + eps) is unchanged up to eps, "
    "while the factor is the same for every update. The missing division still shows in the "
    "logged loss, in a gradient-norm clip and with SGD.",
)

__all__ = [
    "accumulate_from_means",
    "adamw_ratio",
    "reference_accumulate_from_means",
    "reference_weighted_window_update",
    "undivided_gradient",
    "weighted_window_update",
]
