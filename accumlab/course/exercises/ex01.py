"""Exercises for notebook 01 (the single-device loop).

- ``accumulate_window``: write the body of the accumulation loop for one window,
  ``accumulate_window(model, window, objective, forward) -> None``. ``window`` is a list
  of microbatches (mappings of tensors), ``objective`` has ``count(batch) -> int`` and
  ``loss_sum(output, batch) -> Tensor``, and ``forward(model, microbatch)`` returns the
  model's output. After the call, every parameter's ``.grad`` must hold the gradient of
  the window's mean loss per unit, exactly as one full-batch backward pass over all the
  window's examples would give; the caller clears ``.grad`` before and steps after, so
  the function neither clears gradients nor touches the weights.

The checker runs the answer on fresh models and data (an MLP with per-example losses and
a tiny GPT with masked targets, microbatches of unequal sizes), compares the gradient
with the full batch via :func:`accumlab.compare`, and names the usual mistakes: a missing
division, the average of microbatch means, ``zero_grad`` inside the loop, a step inside.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...checks import compare, full_batch_gradient, gradients, split_batch
from ...loop import default_forward
from ...objectives import ExampleLoss, NextTokenLoss, Objective
from ..data import VOCAB_SIZE, Example, collate
from ..models import MLP, TinyGPT
from . import Exercise, fills_grad_only

#: Relative tolerance of the checker: float32 accumulation order changes the last bits only.
RTOL = 1e-4


def reference_accumulate_window(
    model: nn.Module,
    window: Sequence[Mapping[str, Tensor]],
    objective: Objective,
    forward: Callable[[nn.Module, Mapping[str, Tensor]], Any],
) -> None:
    """Backpropagate loss_sum(microbatch) / count(window) for every microbatch."""
    total = sum(objective.count(mb) for mb in window)  # the window's count, before any forward
    for microbatch in window:
        output = forward(model, microbatch)
        loss = objective.loss_sum(output, microbatch) / total
        loss.backward()  # adds into .grad; no zero_grad here, no step here


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


def _cases() -> list[tuple[str, list[int], Callable[[], tuple[nn.Module, dict[str, Tensor], Objective]]]]:
    return [
        ("MLP, cross-entropy per example", [3, 1, 3], lambda: _mlp_case(11, [3, 1, 3], "cross_entropy")),
        ("MLP, mean squared error per example", [2, 5], lambda: _mlp_case(12, [2, 5], "mse")),
        ("tiny GPT, masked next-token targets", [1, 2, 1, 2], lambda: _gpt_case(13, [1, 2, 1, 2])),
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
    """Name the mistake whose gradient ``got`` reproduces, if it is a known one."""
    total, a = sum(counts), len(counts)
    known = [
        (sum(parts), f"it is {total} times the full-batch gradient: divide each microbatch's "
         f"loss sum by the window's count ({total}), not by nothing"),
        (sum(p / (n * a) for p, n in zip(parts, counts, strict=True)),
         "it is the average of the microbatch means: that weights a unit in a small microbatch "
         "more than one in a big microbatch; divide each loss sum by the window's total count"),
        (sum(p / n for p, n in zip(parts, counts, strict=True)),
         "it is the sum of the microbatch means: divide each loss sum by the window's total count"),
    ]
    known += [
        (parts[-1] * scale, "only the last microbatch's gradient survived: clear gradients once "
         "before the window (the caller does), never inside the microbatch loop")
        for scale in (1.0 / total, 1.0 / counts[-1], 1.0 / (counts[-1] * a), 1.0)
    ]
    for expected, message in known:
        if _close(got, expected):
            return message
    return None


def check_accumulate_window(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` fills ``.grad`` with the full-batch gradient on every case
    (relative error at most :data:`RTOL`), else what went wrong, naming a known mistake."""
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
            answer(model, window, objective, default_forward)
            got = gradients(model)
            where = f"on {name}, microbatches of {sizes} examples"
            if counts != sizes:
                where += f" ({counts} {objective.unit}s)"
            problem = fills_grad_only(model, weights, where)
            if problem is not None:
                return problem
            comparison = compare(reference, got)
            if comparison.ok(RTOL):
                continue
            flat = _flat(got)
            if float(flat.abs().max()) == 0.0:
                return f"{where}: the gradient is zero; call .backward() on each microbatch's loss"
            mistake = _diagnose(flat, parts, counts)
            if mistake is not None:
                return f"{where}: {mistake}"
            return (
                f"{where}: the gradient differs from the full batch "
                f"(max relative error {comparison.max_rel_error:.3g} > {RTOL:g})"
            )
    return None


accumulate_window = Exercise(
    name="accumulate_window",
    checker=check_accumulate_window,
    hints=(
        "Count first: the window's denominator is objective.count summed over all its "
        "microbatches, known before any forward pass.",
        "For each microbatch: output = forward(model, microbatch); then "
        "objective.loss_sum(output, microbatch) / total; then .backward().",
        "backward() adds into .grad, which is the accumulation; do not clear gradients or "
        "step inside this function.",
    ),
    reference=inspect.getsource(reference_accumulate_window),
)
