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

:func:`buffer_settings` gives the job's own normalizers for a split of a window of ``A``
slices of ``m`` completions (``current_gradient_accumulation_steps`` is the split's
microbatch count, set by :func:`accumlab.hf.steps.train_window`):

- a window of one microbatch that is a whole window (``A'`` = 1: the reference ``(N,
  1)``, or a microbatch run alone) is its own generation batch (``steps_per_generation``
  1) carrying its share of the frozen count, ``num_items_in_batch · (its completions) /
  (the generation batch's)``: the count itself when the generation batch is the window,
  as by default. A loss that divides each slice by the whole generation batch's count
  with ``steps_per_generation`` > ``A`` (TRL's DAPO before its PR #6024) gives ``A /
  steps_per_generation`` times this: a division once too often;
- any other split keeps the generation batch (``steps_per_generation`` scaled by ``m /
  m'``) and the count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .capture import CapturedWindow

#: The key of the count in a generated microbatch (TRL's GRPO and RLOO).
COUNT = "num_items_in_batch"


def generates(window: CapturedWindow) -> bool:
    """True when the window's microbatches came from a trainer that generates (their
    generated slices were recorded)."""
    return bool(window.microbatches) and all(mb.prepared is not None for mb in window.microbatches)


def share(value: Any, fraction: float) -> Any:
    """``fraction`` of a count (a float32 tensor on the count's device, or a float)."""
    if isinstance(value, Tensor):
        return value.detach().double().mul(fraction).to(torch.float32)
    return float(value) * fraction


def buffer_settings(
    trainer: Any, m: int, sizes: tuple[int, ...], accumulation_steps: int
) -> tuple[dict[str, Any], float | None]:
    """``(settings, fraction)`` for a split of ``sizes`` completions per microbatch whose
    job divides by ``accumulation_steps``, in a window of slices of ``m`` (see the module
    docstring): the arguments to set, and the fraction of the frozen count each of its
    microbatches carries (None: the count as it is)."""
    if not hasattr(trainer.args, "steps_per_generation"):
        return {}, None
    spg = trainer.args.steps_per_generation or accumulation_steps
    if accumulation_steps == 1 and len(sizes) == 1:
        return {"steps_per_generation": 1}, sizes[0] / (m * spg)
    return {"steps_per_generation": max(1, spg * m // sizes[0])}, None


__all__ = ["COUNT", "buffer_settings", "generates", "share"]
