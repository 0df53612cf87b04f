"""Exercise for notebook 07 (the capstone clinic).

- ``clinic_window``: write ``train_one_window(model, optimizer, scheduler, window)``, one
  update from one window, for a causal language model called like a Hugging Face model
  (``model(input_ids=..., attention_mask=...).logits``). ``window`` is a list of
  microbatch dicts with ``input_ids``, ``attention_mask`` and unshifted ``labels`` (-100
  where there is no target). The function makes exactly one update from the window's
  token-mean loss and advances the scheduler once.

The checker is :func:`accumlab.audit`: it runs the answer on its controlled set and
passes it when the audit finds nothing; otherwise it names the mistakes it measured and
the fix of the first one.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...checks import ADVICE, audit
from . import Exercise


def reference_train_one_window(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    window: Sequence[Mapping[str, Tensor]],
) -> float:
    """One update from ``window``; returns the window's mean loss per target."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)  # before any forward
    loss_sum = 0.0
    for mb in window:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        part = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            mb["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (part / total).backward()  # every target weighs 1 / total, whatever its microbatch
        loss_sum += part.item()  # a float: no graph outlives the microbatch
        del logits, part
    optimizer.step()  # once per window
    scheduler.step()  # once per update
    return loss_sum / total


def check_train_one_window(answer: Any) -> str | None:
    """None when :func:`accumlab.audit` finds nothing wrong with ``answer``; else what it found."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    report = audit(answer)
    if report.ok:
        return None
    if report.mistakes:
        first = report.mistakes[0]
        return (
            f"the audit found {', '.join(report.mistakes)}. {first}: "
            f"{report.evidence[first]}. Fix: {ADVICE[first][1]}"
        )
    return "the audit found: " + "; ".join(report.other)


clinic_window = Exercise(
    name="clinic_window",
    checker=check_train_one_window,
    hints=(
        "Count the window's targets first, on the labels: (labels[:, 1:] != -100).sum() "
        "summed over the microbatches.",
        "Per microbatch: the summed cross-entropy (reduction='sum', ignore_index=-100) "
        "divided by that count, then backward. No zero_grad and no step inside the loop.",
        "After the loop: optimizer.step(), then scheduler.step(); clear the gradients once "
        "per window (before the loop or after the step). Log part.item(), not the tensor.",
    ),
    reference=inspect.getsource(reference_train_one_window),
)
