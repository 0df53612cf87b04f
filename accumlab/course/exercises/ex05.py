"""Exercises for notebook 05 (memory instrumentation).

- ``window_without_leaks``: write one update from one window *and* the number a training
  log keeps, ``train_one_window(model, window, optimizer, objective) -> float``. ``window``
  is a list of microbatches (mappings with ``input_ids`` and ``labels``), ``objective`` a
  ``NextTokenLoss``. The function clears the gradients, backpropagates every microbatch's
  ``loss_sum / count(window)``, steps the optimizer once, and returns the window's mean
  loss per target as a Python ``float``. Whatever it returns is kept by the caller in a
  list for the whole run, so it must not hold a tensor, a graph or anything else that
  grows window after window.

The checker runs the answer for several windows on a fresh tiny GPT, keeping every
returned value as a logging loop would, with a :class:`~accumlab.memory.MemoryMeter`
tracking every tensor the answer allocates. It checks the type of the returned value, the
value against the reference, the weights after the last update, and that the live bytes
after each window stay flat once the first update is done.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...memory import MemoryMeter, format_bytes
from ...objectives import NextTokenLoss, Objective
from ..data import VOCAB_SIZE
from ..models import TinyGPT
from . import Exercise

#: Relative tolerance on logged losses and weights (float32, same order of operations).
RTOL = 1e-4
WINDOWS = 4


def reference_train_window(
    model: nn.Module,
    window: Sequence[Mapping[str, Tensor]],
    optimizer: torch.optim.Optimizer,
    objective: Objective,
) -> float:
    """One update from ``window``; returns its mean loss per target as a float."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(objective.count(mb) for mb in window)  # the window's targets, before any forward
    loss_sum = 0.0
    for mb in window:
        part = objective.loss_sum(model(mb["input_ids"]), mb)
        (part / total).backward()
        loss_sum += part.item()  # a Python float: no tensor, no graph survives the microbatch
        del part
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / total


def _data(seed: int) -> list[list[dict[str, Tensor]]]:
    """``WINDOWS`` windows of two microbatches with unequal lengths and masked prompts."""
    g = torch.Generator().manual_seed(seed)
    windows = []
    for _ in range(WINDOWS):
        window = []
        for rows, seq in ((2, 12), (3, 7)):
            ids = torch.randint(2, VOCAB_SIZE, (rows, seq), generator=g)
            labels = ids.clone()
            labels[:, :3] = -100  # a prompt of three tokens is not supervised
            window.append({"input_ids": ids, "labels": labels})
        windows.append(window)
    return windows


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(VOCAB_SIZE, block_size=16, n_layer=1, n_head=2, n_embd=16)


def _run(
    fn: Callable[..., Any], model: nn.Module, windows: list[list[dict[str, Tensor]]]
) -> tuple[list[Any], list[int]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    objective = NextTokenLoss()
    meter = MemoryMeter("cpu")
    logged: list[Any] = []  # kept for the whole run, as a training log would
    live: list[int] = []
    with meter.track():
        for window in windows:
            logged.append(fn(model, window, optimizer, objective))
            live.append(meter.live_bytes)
    return logged, live


def check_train_one_window(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` returns the right floats, trains the weights like the reference,
    and leaves the live bytes flat from window to window; else what went wrong."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    with torch.random.fork_rng(devices=[]):
        windows = _data(5)
        base = _model(5)
        model = copy.deepcopy(base)
        expected, _ = _run(reference_train_window, copy.deepcopy(base), windows)
        reference_model = copy.deepcopy(base)
        _run(reference_train_window, reference_model, windows)
        got, live = _run(answer, model, windows)
    for i, value in enumerate(got):
        if isinstance(value, Tensor):
            graph = " with its autograd graph" if value.grad_fn is not None else ""
            return (
                f"window {i} returned a tensor{graph}; the caller keeps every returned value, "
                "so return a Python float (loss.item(), or accumulate floats)"
            )
        if not isinstance(value, (float, int)):
            return f"window {i} returned a {type(value).__name__}; return a Python float"
    # Window 0 runs at the same weights as the reference: its value alone says whether the
    # logged number is right. Later values also depend on the updates, checked next.
    if abs(got[0] - expected[0]) > RTOL * abs(expected[0]):
        return _value_problem(0, got[0], expected[0])
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        scale = float(q.detach().abs().max())
        if float((p.detach() - q.detach()).abs().max()) > RTOL * max(scale, 1e-12):
            return (
                f"the weights differ from the reference after {WINDOWS} windows (first at "
                f"{name}): clear gradients once per window, divide each microbatch's loss sum "
                "by the window's target count, step once per window"
            )
    for i, (value, ref) in enumerate(zip(got, expected, strict=True)):
        if abs(value - ref) > RTOL * abs(ref):
            return _value_problem(i, value, ref)
    growth = [b - a for a, b in zip(live[1:], live[2:], strict=False)]
    if any(g > 0 for g in growth):
        return (
            f"the live bytes grew after every window ({', '.join(format_bytes(g) for g in growth)}"
            "): something keeps a tensor alive across windows (a list of losses, an output)"
        )
    return None


def _value_problem(i: int, value: float, ref: float) -> str:
    return (
        f"window {i}: returned {value:.6f}, expected the mean loss per target {ref:.6f}: the "
        "sum of token losses over the window's target count"
    )


window_without_leaks = Exercise(
    name="window_without_leaks",
    checker=check_train_one_window,
    hints=(
        "Count the window's targets first: sum(objective.count(mb) for mb in window).",
        "Backpropagate objective.loss_sum(model(mb['input_ids']), mb) / total for each "
        "microbatch; step once after the loop.",
        "For the log, add part.item() (a Python float) to a running sum; a tensor would "
        "keep its graph alive for as long as the log keeps it.",
    ),
    reference=inspect.getsource(reference_train_window),
)
