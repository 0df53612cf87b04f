"""The Trainer's own steps for one window, as configured or as a job of another split.

:func:`train_window` runs ``training_step`` on each microbatch of a window with the
gradient sync on the last only, as the Trainer's loop does. :func:`run_split` runs the
same examples as a job configured for another split (``m'`` examples per microbatch,
``A'`` microbatches) would: ``per_device_train_batch_size`` and
``gradient_accumulation_steps`` set to it, the job's own ``get_batch_samples`` (its
``num_items_in_batch``) and ``training_step`` (its ``compute_loss``, division by the
accumulation steps, autocast). For a trainer that generates inside ``training_step``,
its ``_prepare_inputs`` is made to hand back the frozen generated microbatches instead of
generating (see :mod:`accumlab.hf.generated`), with the split's other settings
(``steps_per_generation``) set the same way. Every setting is put back afterwards.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .capture import CapturedWindow, held_gradient


@dataclass
class Replayed:
    """The microbatches one split of a window replays: ``size`` examples per microbatch
    (the largest), the microbatches, the ``A`` a job of the split divides by
    (``accumulation_steps``: more than the microbatches for a short window), the other
    argument values a job of this split has, and whether the microbatches are a
    generating trainer's frozen buffer (handed to its loss as they are) rather than
    collated inputs (run through ``get_batch_samples`` first)."""

    size: int
    batches: list[dict[str, Any]]
    accumulation_steps: int
    settings: dict[str, Any] = field(default_factory=dict)
    generated: bool = False


def batch_samples(trainer: Any, iterator: Any, count: int, device: Any) -> tuple[list[Any], Any]:
    """``trainer.get_batch_samples`` as this release calls it: with ``device`` since 4.48
    (and in a subclass that takes it), without it in 4.46-4.47. Read off the Trainer's
    class, not the instance: a wrapper set on the instance (the audit's own count fix
    takes ``*device``) calls the class's method the way the release does."""
    params = inspect.signature(type(trainer).get_batch_samples).parameters  # with self
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    takes_device = "device" in [p.name for p in positional] or len(positional) >= 4
    if takes_device:
        return trainer.get_batch_samples(iterator, count, device)
    return trainer.get_batch_samples(iterator, count)


def train_window(trainer: Any, model: Any, batches: Sequence[Any], num_items: Any) -> list[Any]:
    """The Trainer's own steps for one window: ``training_step`` on each microbatch, the
    gradient sync on the last only (``accelerator.no_sync`` before it). Returns what each
    step returned (the numbers the Trainer adds to its logged loss)."""
    trainer.current_gradient_accumulation_steps = len(batches)
    returned = []
    for i, inputs in enumerate(batches):
        last = i == len(batches) - 1
        trainer.accelerator.gradient_state._set_sync_gradients(last)
        sync = contextlib.nullcontext() if last else trainer.accelerator.no_sync(model)
        with sync:
            returned.append(trainer.training_step(model, inputs, num_items))
    return returned


@contextlib.contextmanager
def configured_as(trainer: Any, split: Replayed) -> Iterator[None]:
    """The Trainer's arguments as a job of ``split`` has them, put back on exit; for a
    generated split, ``_prepare_inputs`` hands back its microbatches one per call."""
    args = trainer.args
    settings = {
        "per_device_train_batch_size": split.size or args.per_device_train_batch_size,
        "gradient_accumulation_steps": split.accumulation_steps,
        **split.settings,
    }
    saved = {k: getattr(args, k) for k in settings}
    had = "_prepare_inputs" in vars(trainer)
    own = vars(trainer).get("_prepare_inputs")
    try:
        for k, v in settings.items():
            setattr(args, k, v)
        if split.generated:
            frozen = iter(split.batches)
            device = args.device

            def _prepare_inputs(_: Any, *a: Any, **k: Any) -> dict[str, Any]:
                return {
                    key: v.to(device) if isinstance(v, Tensor) else v
                    for key, v in next(frozen).items()
                }

            trainer._prepare_inputs = _prepare_inputs
        yield
    finally:
        for k, v in saved.items():
            setattr(args, k, v)
        if split.generated:
            if had:
                trainer._prepare_inputs = own
            else:
                vars(trainer).pop("_prepare_inputs", None)


def run_split(
    trainer: Any, model: Any, window: CapturedWindow, split: Replayed, count: Any = None
) -> tuple[list[Tensor | None], float | None]:
    """The job's gradient for ``split`` (the ``.grad`` tensors themselves, fresh ones) and
    the loss it would log for it (the sum of the steps' returns; None where one is not a
    number). ``count`` replaces the Trainer's ``num_items_in_batch``."""
    model.zero_grad(set_to_none=True)
    first = window.microbatches[0]
    (first.loss_rng if split.generated and first.loss_rng is not None else first.rng).restore()
    with configured_as(trainer, split):
        if split.generated:
            samples, num_items = [[] for _ in split.batches], first.num_items_in_batch
        else:
            samples, num_items = batch_samples(
                trainer, iter(split.batches), len(split.batches), trainer.args.device
            )
        if count is not None:
            on = num_items.device if isinstance(num_items, Tensor) else None
            num_items = torch.as_tensor(count, device=on) if on is not None else count
        returned = train_window(trainer, model, samples, num_items)
    total = 0.0
    for r in returned:
        try:
            total += float(r.detach().float().mean()) if isinstance(r, Tensor) else float(r)
        except (TypeError, ValueError):
            return held_gradient(trainer.model), None
    return held_gradient(trainer.model), total


def collated(window: CapturedWindow) -> list[Mapping[str, Any]] | None:
    """The window's microbatches as collated mappings, or None when the Trainer was handed
    something else (a list of dataset rows: a trainer that generates)."""
    inputs = [mb.inputs for mb in window.microbatches]
    return inputs if all(isinstance(b, Mapping) for b in inputs) else None


__all__ = ["Replayed", "batch_samples", "collated", "configured_as", "run_split", "train_window"]
