"""Online RL: the splits of a window's generated buffer, frozen.

A trainer that generates inside ``training_step`` (TRL's ``GRPOTrainer`` and
``RLOOTrainer``: its ``_prepare_inputs`` turns dataset rows into completions) trains each
microbatch on a slice of its generation batch: prompt and completion ids and masks, the
advantages, the old log-probabilities, and ``num_items_in_batch``, the completion tokens
of the whole generation batch (all ranks), which spans ``steps_per_generation``
microbatches. The capture records each microbatch's slice as the loss saw it
(:attr:`accumlab.hf.capture.Microbatch.prepared`); replaying those frozen slices, the
completions are the same at every split, so a gradient that moves with the split moves
because of the loss's normalization, not because of sampling.

The splits of a window of ``A`` slices of ``m`` completions (the job's own normalizers
set as a job of that split has them: ``current_gradient_accumulation_steps``,
``steps_per_generation`` and ``num_items_in_batch``):

- ``(m·A, 1)``, the window as one microbatch and as its own generation batch
  (``steps_per_generation`` 1), with its share of the frozen count,
  ``num_items_in_batch · A / steps_per_generation`` (the count itself when the
  generation batch is the window, as by default). A loss that divides each slice by the
  whole generation batch's count with ``steps_per_generation`` > ``A`` (TRL's DAPO before
  its PR #6024) gives ``A / steps_per_generation`` times this: a division once too often;
- ``(m/2, 2A)`` or ``(1, m·A)``: the slices cut finer, the generation batch the same
  (``steps_per_generation`` scaled by ``m / m'``, the count kept).

The slices join only when their tensors have one width (slices of one generation batch
do; a window that spans two generations is not joined: its finer split still runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .capture import CapturedWindow
from .rows import finer, join_rows, rows_of
from .steps import Split

#: The key of the count in a generated microbatch (TRL's GRPO and RLOO).
COUNT = "num_items_in_batch"


def generates(window: CapturedWindow) -> bool:
    """True when the window's microbatches came from a trainer that generates (their
    generated slices were recorded)."""
    return bool(window.microbatches) and all(mb.prepared is not None for mb in window.microbatches)


def _share(value: Any, fraction: float) -> Any:
    """``fraction`` of a count (a float tensor on the count's device, or a float)."""
    if isinstance(value, Tensor):
        return value.detach().double().mul(fraction).to(torch.float32)
    return float(value) * fraction


def buffer_splits(window: CapturedWindow, trainer: Any) -> tuple[int, list[Split], list[str]]:
    """``(m, splits, skipped)`` for a generating trainer's window (see the module
    docstring): the configured microbatch size, the other splits of its frozen buffer,
    and why a split could not be formed."""
    slices: list[Mapping[str, Any]] = [mb.prepared for mb in window.microbatches]  # type: ignore[misc]
    m = rows_of(slices[0], trainer.args.per_device_train_batch_size)
    sizes = [rows_of(s, m) for s in slices]
    a = len(slices)
    has_spg = hasattr(trainer.args, "steps_per_generation")
    spg = getattr(trainer.args, "steps_per_generation", None) or a
    splits: list[Split] = []
    skipped: list[str] = []
    if a > 1:
        joined = join_rows(slices, sizes, pad=False)
        if joined is None:
            skipped.append(f"({sum(sizes)}, 1): the slices do not join (the window spans generations)")
        else:
            if COUNT in joined:
                joined[COUNT] = _share(joined[COUNT], a / spg)
            settings = {"steps_per_generation": 1} if has_spg else {}
            splits.append(Split(sum(sizes), [joined], settings, generated=True))
    cut = finer(slices, sizes)
    if cut is not None:
        size, batches = cut
        steps = spg * m // size if len(set(sizes)) == 1 else spg * len(batches) // a
        settings = {"steps_per_generation": steps} if has_spg else {}
        splits.append(Split(size, batches, settings, generated=True))
    return m, splits, skipped


__all__ = ["COUNT", "buffer_splits", "generates"]
