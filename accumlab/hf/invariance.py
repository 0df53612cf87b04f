"""Split invariance: the check for a job whose objective the audit does not know.

A correct window-level objective gives the same gradient for the same examples however
they are split into microbatches: the loss of a window is a sum over its examples (or
tokens, or pairs) divided once by the window's count. That property can be checked
without knowing the objective. :func:`split_invariance` takes the window the job just
ran, ``A`` microbatches of ``m`` examples, and runs the **same examples** through the
job's own ``get_batch_samples`` (its ``num_items_in_batch``), ``training_step``
(its ``compute_loss``, division by the accumulation steps, autocast) and collated
tensors, split finer: ``(m/2, 2A)`` (each microbatch's rows cut in halves, when ``m`` is
even) and ``(1, m·A)`` (each example alone). The sliced microbatches keep the collator's
padding, so the check needs no collator and runs inside a real run too
(:class:`~accumlab.hf.callback.AuditCallback`).

For each split it reports the factor ``a`` in ``g(m, A) ≈ a · g(split)`` (least squares)
and the relative error ``‖g(m, A) − g(split)‖ / ‖g(split)‖``. All within the tolerance:
ok. A factor of ``A_split / A`` with a small residual (the gradient shrinks as ``A``
grows) is ``double_division``, a factor of about ``A / A_split`` (it grows with ``A``:
per-microbatch means summed, the ``Trainer`` no longer dividing by ``A``) is
``num_items_ignored``, anything else ``depends_on_split``.

It checks the property, not the objective's definition: a loss that is wrong the same
way at every split (a wrong formula, a wrong constant factor) passes. It needs steps that
draw no random numbers (dropout changes with the split) and ``m`` of at least 2.
Memory: the job's gradient held (no copy) and one more gradient in ``.grad``, one
microbatch's activations at a time; time: one window per split.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .capture import CapturedWindow, held_gradient
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
    """What :func:`split_invariance` found: the configured split, each finer split's
    measure, the names and their evidence (empty when invariant), or ``reason`` when it
    could not check."""

    micro_batch_size: int
    accumulation_steps: int
    splits: list[SplitMeasure]
    mistakes: list[str]
    evidence: dict[str, str]
    reason: str = ""


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


def slice_rows(batch: dict[str, Any], start: int, stop: int, examples: int) -> dict[str, Any]:
    """Examples ``start:stop`` of a collated microbatch of ``examples`` examples: a tensor
    whose leading size is ``k · examples`` holds ``k`` blocks of one row per example
    (chosen rows, then rejected rows), each block sliced alike; anything else is kept."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] % examples == 0 and v.shape[0] >= examples:
            blocks = v.shape[0] // examples
            parts = [v[j * examples + start : j * examples + stop] for j in range(blocks)]
            out[k] = torch.cat(parts).clone() if blocks > 1 else parts[0].clone()
        else:
            out[k] = v
    return out


def finer_splits(window: CapturedWindow, examples: int | None = None) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(m', microbatches)`` for ``(m/2, 2A)`` (``m`` even) and ``(1, m·A)``; none for
    ``m = 1`` or microbatches of unequal sizes."""
    batches = [mb.inputs for mb in window.microbatches]
    sizes = {rows_of(b, examples) for b in batches}
    if len(sizes) != 1:
        return []
    (m,) = sizes
    out = []
    for size in sorted({m // 2, 1} - {0}, reverse=True):
        if size >= m or m % size:
            continue
        out.append((size, [slice_rows(b, s, s + size, m) for b in batches for s in range(0, m, size)]))
    return out


def batch_samples(trainer: Any, iterator: Any, count: int, device: Any) -> tuple[list[Any], Any]:
    """``trainer.get_batch_samples`` as this release calls it: with ``device`` since 4.48
    (and in a subclass that takes it), without it in 4.46-4.47."""
    import inspect

    params = inspect.signature(trainer.get_batch_samples).parameters
    takes_device = "device" in params or len([p for p in params.values() if p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3
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


def _named(s: SplitMeasure, ratio: float, tol: float) -> str:
    """The name for one split; ``ratio`` is A(split) / A(configured). A gradient divided by
    A once too often is ``ratio`` times the split's; one summed over per-microbatch means,
    about ``1 / ratio`` times."""
    close = max(tol, 1e-3)
    if s.residual <= close and abs(s.factor / ratio - 1.0) <= close:
        return "double_division"
    if s.factor > 0 and abs(math.log(s.factor * ratio)) <= 0.2:
        return "num_items_ignored"
    return "depends_on_split"


def split_invariance(trainer: Any, model: Any, window: CapturedWindow, tol: float) -> Invariance:
    """Run the window's examples at the finer splits (see the module docstring) and
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
    splits = finer_splits(window, examples)
    if not splits:
        return Invariance(m, a, [], [], {}, reason=(
            f"a microbatch of {m} example row{'s' if m != 1 else ''}"
            " cannot be split finer: use per_device_train_batch_size >= 2 for the audit"))
    g, f = window.gradient, window.factor
    device = trainer.args.device
    measures: list[SplitMeasure] = []
    args = trainer.args
    configured = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    for size, batches in splits:
        model.zero_grad(set_to_none=True)
        window.microbatches[0].rng.restore()
        # the split as the job would be configured for it: a loss that reads A sees it
        args.per_device_train_batch_size, args.gradient_accumulation_steps = size, len(batches)
        try:
            samples, num_items = batch_samples(trainer, iter(batches), len(batches), device)
            train_window(trainer, model, samples, num_items)
        finally:
            args.per_device_train_batch_size, args.gradient_accumulation_steps = configured
        other = held_gradient(trainer.model)
        oo = dot(other, other)
        factor = f * dot(g, other) / oo if oo > 0 else math.nan
        error = distance(g, f, other, 1.0) / math.sqrt(oo) if oo > 0 else math.nan
        g_norm = abs(f) * math.sqrt(dot(g, g))
        residual = distance(g, f, other, factor) / g_norm if g_norm > 0 and oo > 0 else math.nan
        measures.append(SplitMeasure(size, len(batches), factor, error, residual))
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
                + (f" (A grew {ratio:g}x and the gradient shrank {ratio:g}x: one division by A "
                   "too many)" if name == "double_division" else "")
            )
    return Invariance(m, a, measures, mistakes, evidence)


__all__ = [
    "Invariance",
    "SplitMeasure",
    "batch_samples",
    "finer_splits",
    "rows_of",
    "slice_rows",
    "split_invariance",
    "train_window",
]
