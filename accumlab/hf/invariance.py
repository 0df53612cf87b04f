"""Split invariance on the Trainer's own path: the check for a job whose objective the
audit does not know, or whose reference cannot run.

A correct window-level objective gives the same gradient for the same examples however
they are split into microbatches: the loss of a window is a sum over its examples (or
tokens, or pairs) divided once by the window's count. That property can be checked
without knowing the objective, and without a reference forward pass. The window the job
just ran, ``A`` microbatches, runs again on the job's own path (:mod:`accumlab.hf.steps`)
at other splits of the **same examples**:

- ``(n, 1)``, the whole window in one microbatch (its ``n`` examples), where the
  microbatches can be joined (right-padded to one width; not for left padding or packing
  kernels' keys) and it fits in memory (an out-of-memory error skips it). It is the
  window as one batch, the reference: a job that accumulates (``A`` > 1) and differs from
  it is wrong, and named;
- one finer split: ``(m/2, 2A)`` when every microbatch holds the same even ``m``, else
  ``(1, n)`` (each microbatch's rows cut; a preference batch's chosen and rejected blocks
  cut alike). It names the mistake when the window cannot be joined; otherwise a
  difference it shows while the whole window agrees is a note about that split.

A job of ``A`` = 1 runs its window as one batch: its own update is the window's, and a
dependence on the split shows only at an ``A`` it does not run, a note about that ``A``,
never a mistake of this run. For a trainer that generates inside ``training_step``
(online RL), the splits are those of its frozen generated buffer
(:mod:`accumlab.hf.generated`).

For each split the report gives the factor ``a`` in ``g(m, A) ≈ a · g(split)`` (least
squares), the relative error ``‖g(m, A) − g(split)‖ / ‖g(split)‖`` and what the split
would log. A factor of ``A_split / A`` with a small residual (the gradient shrinks as
``A`` grows) is ``double_division``, a factor of about ``A / A_split`` (per-microbatch
means summed, the ``Trainer`` no longer dividing by ``A``) ``num_items_ignored``; for a
generated buffer, a factor of ``A / steps_per_generation`` is the generation batch's
count used as the window's (``double_division`` when it is smaller than 1,
``wrong_normalization`` when larger); anything else ``depends_on_split``. The names come
from the shared table, :data:`accumlab.mistakes.MISTAKES`.

The count is an integer fact the split cannot show (every split counts the same labels):
for a causal LM whose Trainer passed a ``num_items_in_batch`` other than the targets after
the shift, :func:`count_check` runs the configured window once more with the targets as
the count; a gradient that moves by exactly their ratio divides by the count, and is
named ``count_before_shift``.

It checks the property, not the objective's definition: a loss that is wrong the same
way at every split (a wrong formula, a wrong constant factor) passes. It needs steps
whose loss draws no random numbers (dropout changes with the split) and a window of at
least 2 examples. Memory: the job's gradient held (no copy) and one more gradient in
``.grad``; activations of one microbatch at a time, except the ``(n, 1)`` split, which
runs the window's examples in one forward pass; time: one window per split, one more for
the count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..least_squares import least_squares_products
from .capture import CapturedWindow, unwrapped_model
from .generated import buffer_splits, generates
from .objectives import is_causal_lm, job_targets
from .reference import distance, dot
from .rows import finer, join_rows, rows_of
from .steps import Split, collated, run_split


@dataclass
class SplitMeasure:
    """The same examples as ``micro_batch_size`` × ``accumulation_steps``: the configured
    window's gradient is ``factor`` times this split's, with ``relative_error``;
    ``residual``: ‖g(m, A) − factor · g(split)‖ / ‖g(m, A)‖, what the factor leaves;
    ``logged``: the loss the Trainer would log for this split (the sum of its steps'
    returns; None when one is not a number); ``norm``: this split's gradient norm."""

    micro_batch_size: int
    accumulation_steps: int
    factor: float
    relative_error: float
    residual: float = 0.0
    logged: float | None = None
    norm: float = math.nan


@dataclass
class Invariance:
    """What :func:`split_invariance` found: the configured split (``examples`` in all), each
    other split's measure, the names and their evidence (empty when invariant), notes
    (a dependence at a split the job does not run), what it could not run (``skipped``),
    or ``reason`` when it could not check at all; ``gradient_norm``: the job's own."""

    micro_batch_size: int
    accumulation_steps: int
    splits: list[SplitMeasure]
    mistakes: list[str]
    evidence: dict[str, str]
    reason: str = ""
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    examples: int = 0
    gradient_norm: float = math.nan


def collated_splits(window: CapturedWindow, trainer: Any) -> tuple[int, list[int], list[Split]]:
    """``(m, sizes, splits)`` of a window of collated microbatches: the configured size,
    each microbatch's example count, and ``(n, 1)`` (when they join) and the finer split."""
    examples = trainer.args.per_device_train_batch_size
    batches = collated(window) or []
    sizes = [rows_of(b, examples) for b in batches]
    m = max(sizes, default=0)
    pad_id = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None) or 0
    splits = []
    if len(batches) > 1:
        joined = join_rows(batches, sizes, pad_id)
        if joined is not None:
            splits.append(Split(sum(sizes), [joined]))
    cut = finer(batches, sizes)
    if cut is not None:
        splits.append(Split(cut[0], cut[1]))
    return m, sizes, splits


def _measure(g: Any, f: float, other: list[Tensor | None], split: Split, logged: float | None) -> SplitMeasure:
    oo = dot(other, other)
    gg = f * f * dot(g, g)
    fit = least_squares_products(gg, [f * dot(g, other)], [[oo]])
    error = distance(g, f, other, 1.0) / math.sqrt(oo) if oo > 0 else math.nan
    return SplitMeasure(split.size, split.accumulation_steps, fit.coefficients[0] if oo > 0 else math.nan,
                        error, fit.residual, logged, math.sqrt(oo))


def _named(s: SplitMeasure, ratio: float, tol: float, generation: float | None) -> str:
    """The name for one split; ``ratio`` is A(split) / A(configured), ``generation`` the
    factor a generated buffer's count gives when it is used as the window's (A /
    steps_per_generation; None when they are equal). A gradient divided by A once too
    often is exactly ``ratio`` times the split's; one summed over per-microbatch means
    without the division by A grows with A: about ``1 / ratio`` times (closer to it than
    to 1, on a log scale: the means of uneven microbatches differ)."""
    close = max(tol, 1e-3)
    if generation is not None and s.residual <= close and abs(s.factor / generation - 1.0) <= close:
        return "double_division" if generation < 1 else "wrong_normalization"
    if s.residual <= close and abs(s.factor / ratio - 1.0) <= close:
        return "double_division"
    if s.factor > 0 and abs(math.log(s.factor * ratio)) < 0.5 * abs(math.log(ratio)):
        return "num_items_ignored"
    return "depends_on_split"


def _evidence(name: str, s: SplitMeasure, n: int, m: int, a: int, spg: int | None) -> str:
    said = (f"the same {n} examples: gradient at ({m}, {a}) = {s.factor:.4g} x the one at "
            f"({s.micro_batch_size}, {s.accumulation_steps}), relative error {s.relative_error:.2e}")
    if name in ("double_division", "wrong_normalization") and spg is not None and spg != a:
        said += (f" = A / steps_per_generation = {a}/{spg}: each microbatch is divided by the count "
                 f"of the whole generation batch ({spg} microbatches), not by this window's share of it")
    elif name == "double_division":
        said += (f" (A went from {a} to {s.accumulation_steps} and the gradient by the same factor "
                 "the other way: one division by A too many)")
    return said


def _split_note(s: SplitMeasure, n: int, m: int, a: int, name: str) -> str:
    return (f"at ({s.micro_batch_size}, {s.accumulation_steps}), a split this job does not run, the "
            f"same {n} examples give {1 / s.factor if s.factor else math.inf:.4g} x this gradient "
            f"(relative error {s.relative_error:.1e}): a job of A = {s.accumulation_steps} would be "
            f"{name}, not this one at ({m}, {a})")


def split_invariance(trainer: Any, model: Any, window: CapturedWindow, tol: float) -> Invariance:
    """Run the window's examples at the other splits (see the module docstring) and
    compare. Call it inside :func:`accumlab.hf.state.preserved_trainer`, with the
    window's gradient held in ``window.gradient``; ``model`` is the one ``training_step``
    gets."""
    a = len(window.microbatches)
    spg = None
    if generates(window):
        m, splits, skipped = buffer_splits(window, trainer)
        sizes = [rows_of(mb.prepared or {}, m) for mb in window.microbatches]
        spg = getattr(trainer.args, "steps_per_generation", None)
    elif collated(window) is not None:
        m, sizes, splits = collated_splits(window, trainer)
        skipped = []
    else:
        return Invariance(0, a, [], [], {}, reason=(
            f"{type(trainer).__name__} trains on {type(window.microbatches[0].inputs).__name__} "
            "inputs and generates inside its own training_step without _prepare_inputs: the audit "
            "cannot replay its buffer"))
    n = sum(sizes)
    unchecked = Invariance(m, a, [], [], {}, examples=n)
    if any(mb.random for mb in window.microbatches):
        unchecked.reason = ("the job's loss draws random numbers (dropout), which change with the "
                            "split: turn dropout off to check that its gradient does not depend on the split")
        return unchecked
    g, f = window.gradient, window.factor
    own = abs(f) * math.sqrt(dot(g, g))
    if own == 0:
        unchecked.reason = ("the job's gradient for this window is zero (no target: every label "
                            "masked?), so every split agrees: audit a window that has targets")
        return unchecked
    if not splits:
        unchecked.reason = (f"a window of {n} example{'s' if n != 1 else ''} in {a} microbatch"
                            f"{'es' if a != 1 else ''} cannot be split otherwise: audit a window of "
                            "at least 2 examples (per_device_train_batch_size >= 2)")
        return unchecked
    measures: list[SplitMeasure] = []
    for split in splits:
        try:
            other, logged = run_split(trainer, model, window, split)
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            skipped.append(f"({split.size}, {split.accumulation_steps}) did not fit in memory")
            continue
        measures.append(_measure(g, f, other, split, logged))
        del other
    model.zero_grad(set_to_none=True)
    result = Invariance(m, a, measures, [], {}, skipped=skipped, examples=n, gradient_norm=own)
    generation = a / spg if spg and spg != a else None
    whole = [s for s in measures if s.accumulation_steps == 1]
    for s in measures:
        if s.relative_error <= tol:
            continue
        name = _named(s, s.accumulation_steps / a, tol, generation if s.accumulation_steps == 1 else None)
        if a == 1 or (whole and s not in whole):  # a split this job does not run
            result.notes.append(_split_note(s, n, m, a, name))
        elif name not in result.evidence:
            result.mistakes.append(name)
            result.evidence[name] = _evidence(name, s, n, m, a, spg)
    counted = count_check(trainer, model, window, tol)
    if counted:
        result.mistakes.append("count_before_shift")
        result.evidence["count_before_shift"] = counted
    return result


def count_check(trainer: Any, model: Any, window: CapturedWindow, tol: float) -> str:
    """Evidence that the job's loss divides by a ``num_items_in_batch`` counted before the
    causal shift (empty when it does not): the count differs from the targets after the
    shift, and with the targets as the count the gradient moves by exactly their ratio."""
    batches = collated(window)
    first = window.microbatches[0]
    labels = batches[0].get("labels") if batches else None
    nib = first.num_items_in_batch
    if nib is None or not isinstance(labels, Tensor) or labels.dim() != 2:
        return ""
    if not is_causal_lm(unwrapped_model(trainer)):
        return ""
    count = float(nib.float().reshape(-1)[0]) if isinstance(nib, Tensor) else float(nib)
    targets = sum(job_targets(b, shift=True) for b in batches or [])
    if targets == 0 or count == targets:
        return ""
    g, f = window.gradient, window.factor
    split = Split(trainer.args.per_device_train_batch_size, [dict(b) for b in batches or []])
    other, _ = run_split(trainer, model, window, split, count=targets)
    s = _measure(g, f, other, split, None)
    del other
    model.zero_grad(set_to_none=True)
    expected = targets / count
    if s.residual > max(tol, 1e-3) or abs(s.factor / expected - 1.0) > max(tol, 1e-3) / 10:
        return ""
    return (f"the Trainer's num_items_in_batch is {count:g} where the labels hold {targets:g} targets "
            f"after the shift; with {targets:g} the gradient is {1 / s.factor:.4f} x the job's "
            f"(= {count:g}/{targets:g}): the loss divides by the count")


__all__ = ["Invariance", "SplitMeasure", "collated_splits", "count_check", "split_invariance"]
