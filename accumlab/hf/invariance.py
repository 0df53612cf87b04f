"""Split invariance: the check for a job whose objective the audit does not know.

A correct window-level objective gives the same gradient for the same examples however
they are split into microbatches: the loss of a window is a sum over its examples (or
tokens, or pairs) divided once by the window's count. That property can be checked
without knowing the objective. :func:`split_invariance` takes the window the job just
ran, ``A`` microbatches of ``m`` examples, and runs the **same examples** through the
job's own ``get_batch_samples`` (its ``num_items_in_batch``), ``training_step`` (its
``compute_loss``, division by the accumulation steps, autocast) on its collated tensors,
split otherwise, with the arguments set as a job configured for that split would have
them (``per_device_train_batch_size``, ``gradient_accumulation_steps``):

- ``(m·A, 1)``, the whole window in one microbatch, where the microbatches can be joined
  (right-padded to one width; not for left padding or packing kernels' keys) and it fits
  in memory (an out-of-memory error skips it);
- one finer split: ``(m/2, 2A)`` when ``m`` is even, else ``(1, m·A)`` (each microbatch's
  rows cut; a preference batch's chosen and rejected blocks cut alike).

For each split it reports the factor ``a`` in ``g(m, A) ≈ a · g(split)`` (least squares)
and the relative error ``‖g(m, A) − g(split)‖ / ‖g(split)‖``. All within the tolerance:
ok. A factor of ``A_split / A`` with a small residual (the gradient shrinks as ``A``
grows) is ``double_division``, a factor of about ``A / A_split`` (it grows with ``A``:
per-microbatch means summed, the ``Trainer`` no longer dividing by ``A``) is
``num_items_ignored``, anything else ``depends_on_split``.

The count is an integer fact the split cannot show (every split counts the same labels):
for a causal LM whose Trainer passed a ``num_items_in_batch`` other than the targets after
the shift, :func:`count_check` runs the configured window once more with the targets as
the count; a gradient that moves by exactly their ratio divides by the count, and is
named ``count_before_shift``.

It checks the property, not the objective's definition: a loss that is wrong the same
way at every split (a wrong formula, a wrong constant factor) passes. It needs steps that
draw no random numbers (dropout changes with the split) and ``m`` of at least 2.
Memory: the job's gradient held (no copy) and one more gradient in ``.grad``; activations
of one microbatch at a time, except the ``(m·A, 1)`` split, which runs the window's
examples in one forward pass; time: one window per split, one more for the count.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..least_squares import least_squares_products
from .capture import CapturedWindow, held_gradient, unwrapped_model
from .objectives import IGNORE_INDEX, PACKING_KEYS, is_causal_lm, job_targets
from .reference import distance, dot


@dataclass
class SplitMeasure:
    """The same examples as ``micro_batch_size`` × ``accumulation_steps``: the configured
    window's gradient is ``factor`` times this split's, with ``relative_error``."""

    micro_batch_size: int
    accumulation_steps: int
    factor: float
    relative_error: float
    residual: float = 0.0  # ‖g(m, A) − factor · g(split)‖ / ‖g(m, A)‖: what the factor leaves


@dataclass
class Invariance:
    """What :func:`split_invariance` found: the configured split, each other split's
    measure, the names and their evidence (empty when invariant), what it could not run
    (``skipped``), or ``reason`` when it could not check at all."""

    micro_batch_size: int
    accumulation_steps: int
    splits: list[SplitMeasure]
    mistakes: list[str]
    evidence: dict[str, str]
    reason: str = ""
    skipped: list[str] | None = None


def rows_of(batch: dict[str, Any], examples: int | None = None) -> int:
    """Examples in a collated microbatch: ``examples`` (the configured microbatch size)
    when every tensor's leading size is a multiple of it (a preference batch stacks its
    chosen and rejected rows: 2m), else the smallest leading size its tensors have."""
    sizes = [v.shape[0] for v in batch.values() if isinstance(v, Tensor) and v.dim() >= 1]
    if not sizes:
        return 0
    if examples and all(n % examples == 0 for n in sizes):
        return examples
    return min(sizes)


def _blocks(v: Tensor, examples: int) -> int:
    """How many blocks of one row per example ``v`` holds (0: not a per-example tensor)."""
    return v.shape[0] // examples if v.dim() >= 1 and v.shape[0] % examples == 0 and v.shape[0] >= examples else 0


def slice_rows(batch: dict[str, Any], start: int, stop: int, examples: int) -> dict[str, Any]:
    """Examples ``start:stop`` of a collated microbatch of ``examples`` examples: a tensor
    whose leading size is ``k · examples`` holds ``k`` blocks of one row per example
    (chosen rows, then rejected rows), each block sliced alike; anything else is kept."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        blocks = _blocks(v, examples) if isinstance(v, Tensor) else 0
        if blocks:
            parts = [v[j * examples + start : j * examples + stop] for j in range(blocks)]
            out[k] = torch.cat(parts).clone() if blocks > 1 else parts[0].clone()
        else:
            out[k] = v
    return out


def _pad_value(key: str, pad_id: int) -> int:
    if "label" in key:
        return IGNORE_INDEX
    if "mask" in key or "position" in key:
        return 0
    return pad_id


def _left_padded(batch: dict[str, Any]) -> bool:
    """True when some attention mask has a 0 before a 1 (padding on the left)."""
    for k, v in batch.items():
        if "attention_mask" in k and isinstance(v, Tensor) and v.dim() == 2 and v.shape[1] > 1:
            if bool(((v[:, :-1] == 0) & (v[:, 1:] == 1)).any()):
                return True
    return False


def join_rows(batches: list[dict[str, Any]], examples: int, pad_id: int = 0) -> dict[str, Any] | None:
    """The microbatches as one: each per-example tensor's blocks concatenated block by
    block, right-padded to the widest (labels with -100, masks and positions with 0, ids
    with ``pad_id``); None when they cannot be joined that way (left padding, packing
    kernels' keys, keys or non-tensor values that differ)."""
    first = batches[0]
    if any(k in first for k in PACKING_KEYS) or any(_left_padded(b) for b in batches):
        return None
    if any(b.keys() != first.keys() for b in batches):
        return None
    out: dict[str, Any] = {}
    for key, value in first.items():
        if not isinstance(value, Tensor):
            if any(b[key] != value for b in batches):
                return None
            out[key] = value
            continue
        values = [b[key] for b in batches]
        blocks = {_blocks(v, examples) for v in values}
        if len(blocks) != 1 or not blocks.pop():
            return None
        k = _blocks(value, examples)
        if any(v.shape[2:] != value.shape[2:] or v.dim() != value.dim() for v in values):
            return None
        width = max(v.shape[1] for v in values) if value.dim() >= 2 else None
        padded = [v if width is None or v.shape[1] == width else
                  F.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]), value=_pad_value(key, pad_id))
                  for v in values]
        out[key] = torch.cat([v[j * examples:(j + 1) * examples] for j in range(k) for v in padded])
    return out


def other_splits(window: CapturedWindow, examples: int | None, pad_id: int = 0) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(m', microbatches)`` for ``(m·A, 1)`` when the microbatches join, and the finer
    ``(m/2, 2A)`` (``m`` even) or ``(1, m·A)``; the finer one is missing for ``m = 1``, all
    are for microbatches of unequal sizes."""
    batches = [mb.inputs for mb in window.microbatches]
    sizes = {rows_of(b, examples) for b in batches}
    if len(sizes) != 1:
        return []
    (m,) = sizes
    out = []
    if len(batches) > 1:
        joined = join_rows(batches, m, pad_id)
        if joined is not None:
            out.append((m * len(batches), [joined]))
    if m > 1:
        size = m // 2 if m % 2 == 0 else 1
        out.append((size, [slice_rows(b, s, s + size, m) for b in batches for s in range(0, m, size)]))
    return out


def batch_samples(trainer: Any, iterator: Any, count: int, device: Any) -> tuple[list[Any], Any]:
    """``trainer.get_batch_samples`` as this release calls it: with ``device`` since 4.48
    (and in a subclass that takes it), without it in 4.46-4.47. Read off the Trainer's
    class, not the instance: a wrapper set on the instance (the audit's own count fix
    takes ``*device``) calls the class's method the way the release does."""
    import inspect

    params = inspect.signature(type(trainer).get_batch_samples).parameters  # with self
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_device = "device" in [p.name for p in positional] or len(positional) >= 4
    if takes_device:
        return trainer.get_batch_samples(iterator, count, device)
    return trainer.get_batch_samples(iterator, count)


def train_window(trainer: Any, model: Any, batches: list[Any], num_items: Any) -> None:
    """The Trainer's own steps for one window: ``training_step`` on each microbatch, the
    gradient sync on the last only (``accelerator.no_sync`` before it)."""
    trainer.current_gradient_accumulation_steps = len(batches)
    for i, inputs in enumerate(batches):
        last = i == len(batches) - 1
        trainer.accelerator.gradient_state._set_sync_gradients(last)
        sync = contextlib.nullcontext() if last else trainer.accelerator.no_sync(model)
        with sync:
            trainer.training_step(model, inputs, num_items)


def _run_split(trainer: Any, model: Any, window: CapturedWindow, size: int, batches: list[dict[str, Any]],
               count: Any = None) -> list[Tensor | None]:
    """The job's gradient for ``batches`` (``size`` examples each), configured as a job of
    that split would be; ``count`` replaces the Trainer's ``num_items_in_batch``."""
    model.zero_grad(set_to_none=True)
    window.microbatches[0].rng.restore()
    args = trainer.args
    configured = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    args.per_device_train_batch_size, args.gradient_accumulation_steps = size, len(batches)
    try:
        samples, num_items = batch_samples(trainer, iter(batches), len(batches), args.device)
        if count is not None:
            num_items = torch.as_tensor(count, device=num_items.device) if isinstance(num_items, Tensor) else count
        train_window(trainer, model, samples, num_items)
    finally:
        args.per_device_train_batch_size, args.gradient_accumulation_steps = configured
    return held_gradient(trainer.model)


def _measure(g: Any, f: float, other: list[Tensor | None], size: int, steps: int) -> SplitMeasure:
    oo = dot(other, other)
    gg = f * f * dot(g, g)
    fit = least_squares_products(gg, [f * dot(g, other)], [[oo]])
    error = distance(g, f, other, 1.0) / math.sqrt(oo) if oo > 0 else math.nan
    return SplitMeasure(size, steps, fit.coefficients[0] if oo > 0 else math.nan, error, fit.residual)


def _named(s: SplitMeasure, ratio: float, tol: float) -> str:
    """The name for one split; ``ratio`` is A(split) / A(configured). A gradient divided by
    A once too often is exactly ``ratio`` times the split's; one summed over
    per-microbatch means without the division by A grows with A: about ``1 / ratio``
    times (closer to it than to 1, on a log scale: the means of uneven microbatches differ)."""
    close = max(tol, 1e-3)
    if s.residual <= close and abs(s.factor / ratio - 1.0) <= close:
        return "double_division"
    if s.factor > 0 and abs(math.log(s.factor * ratio)) < 0.5 * abs(math.log(ratio)):
        return "num_items_ignored"
    return "depends_on_split"


def split_invariance(trainer: Any, model: Any, window: CapturedWindow, tol: float) -> Invariance:
    """Run the window's examples at the other splits (see the module docstring) and
    compare. Call it inside :func:`accumlab.hf.state.preserved_trainer`, with the
    window's gradient held in ``window.gradient``; ``model`` is the one ``training_step``
    gets."""
    examples = trainer.args.per_device_train_batch_size
    m = rows_of(window.microbatches[0].inputs, examples) if window.microbatches else 0
    a = len(window.microbatches)
    if any(mb.random for mb in window.microbatches):
        return Invariance(m, a, [], [], {}, reason=(
            "the job's steps draw random numbers (dropout), which change with the split: turn "
            "dropout off to check that its gradient does not depend on the split"))
    pad_id = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None) or 0
    splits = other_splits(window, examples, pad_id)
    if not splits:
        return Invariance(m, a, [], [], {}, reason=(
            f"a window of {a} microbatch{'es' if a != 1 else ''} of {m} example row"
            f"{'s' if m != 1 else ''} cannot be split otherwise: use per_device_train_batch_size "
            ">= 2 for the audit"))
    g, f = window.gradient, window.factor
    measures: list[SplitMeasure] = []
    skipped: list[str] = []
    for size, batches in splits:
        try:
            other = _run_split(trainer, model, window, size, batches)
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            skipped.append(f"({size}, {len(batches)}) did not fit in memory")
            continue
        measures.append(_measure(g, f, other, size, len(batches)))
        del other
    model.zero_grad(set_to_none=True)
    mistakes: list[str] = []
    evidence: dict[str, str] = {}
    for s in measures:
        if s.relative_error <= tol:
            continue
        ratio = s.accumulation_steps / a
        name = _named(s, ratio, tol)
        if name not in evidence:
            mistakes.append(name)
            evidence[name] = (
                f"the same {m * a} examples: gradient at ({m}, {a}) = {s.factor:.4g} x the one at "
                f"({s.micro_batch_size}, {s.accumulation_steps}), relative error {s.relative_error:.2e}"
                + (f" (A went from {a} to {s.accumulation_steps} and the gradient by the same "
                   "factor the other way: one division by A too many)" if name == "double_division" else "")
            )
    counted = count_check(trainer, model, window, tol)
    if counted:
        mistakes.append("count_before_shift")
        evidence["count_before_shift"] = counted
    return Invariance(m, a, measures, mistakes, evidence, skipped=skipped)


def count_check(trainer: Any, model: Any, window: CapturedWindow, tol: float) -> str:
    """Evidence that the job's loss divides by a ``num_items_in_batch`` counted before the
    causal shift (empty when it does not): the count differs from the targets after the
    shift, and with the targets as the count the gradient moves by exactly their ratio."""
    first = window.microbatches[0]
    labels = first.inputs.get("labels") if isinstance(first.inputs, dict) else None
    nib = first.num_items_in_batch
    if nib is None or not isinstance(labels, Tensor) or labels.dim() != 2 or not is_causal_lm(unwrapped_model(trainer)):
        return ""
    count = float(nib.float().reshape(-1)[0]) if isinstance(nib, Tensor) else float(nib)
    targets = sum(job_targets(mb.inputs, shift=True) for mb in window.microbatches)
    if targets == 0 or count == targets:
        return ""
    g, f = window.gradient, window.factor
    batches = [mb.inputs for mb in window.microbatches]
    other = _run_split(trainer, model, window, trainer.args.per_device_train_batch_size, batches,
                       count=targets)
    s = _measure(g, f, other, 0, 0)
    del other
    model.zero_grad(set_to_none=True)
    expected = targets / count
    if s.residual > max(tol, 1e-3) or abs(s.factor / expected - 1.0) > max(tol, 1e-3) / 10:
        return ""
    return (f"the Trainer's num_items_in_batch is {count:g} where the labels hold {targets:g} targets "
            f"after the shift; with {targets:g} the gradient is {1 / s.factor:.4f} x the job's "
            f"(= {count:g}/{targets:g}): the loss divides by the count")


__all__ = [
    "Invariance",
    "SplitMeasure",
    "batch_samples",
    "count_check",
    "join_rows",
    "other_splits",
    "rows_of",
    "slice_rows",
    "split_invariance",
    "train_window",
]
