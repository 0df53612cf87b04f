"""Split invariance on the Trainer's own path: the Trainer adapter of the one engine.

The check itself lives in :mod:`accumlab.invariance` (which splits run, the comparison,
the names from the one table). This adapter gives the engine its ``run(split)``: the
window the job just ran, its examples (the rows of its microbatches, in order) cut into
the split's microbatches and run through the job's own steps
(:func:`accumlab.hf.steps.run_split`: ``get_batch_samples`` and its
``num_items_in_batch``, ``training_step`` with its ``compute_loss``, division by the
accumulation steps and autocast), with the arguments a job of that split has. A split's
microbatch that is one of the window's own microbatches is replayed as collated; rows of
one microbatch are sliced out; rows of several are joined, right-padded to one width
(not for left padding or packing kernels' keys: the window is then not joined, and the
configured split itself is the reference). For a trainer that generates inside
``training_step`` (online RL) the rows are its frozen generated buffer, never padded, with
its own normalizers for the split (:mod:`accumlab.hf.generated`). The replay of the
configured split must give the job's own gradient, or the job is not checked.

What the adapter adds to the engine's verdict, for a Trainer job as it is configured:

- only the splits this job runs decide: with ``A`` > 1, the configured split against the
  whole window as one microbatch (and a short last window when the job's epoch has one),
  or, where the window cannot run whole, any dependence at all; a job of ``A`` = 1 runs
  its window as one batch. A dependence at any other split is a note about that split,
  never a mistake of this run;
- the engine's ``sum_of_means`` is the Trainer's ``num_items_in_batch`` ignored:
  ``num_items_ignored``;
- for a generated buffer whose ``steps_per_generation`` differs from ``A``, a factor of
  ``A / steps_per_generation`` against the whole window is the generation batch's count
  used as the window's: ``double_division`` below 1, ``wrong_normalization`` above;
- the count, an integer fact no split can show (every split counts the same labels): for
  a causal LM whose Trainer passed a ``num_items_in_batch`` other than the targets after
  the shift, :func:`count_check` runs the configured window once more with the targets as
  the count; a gradient that moves by exactly their ratio is ``count_before_shift``;
- what each split would log (the sum of its steps' returns) and the gradient norms, for
  :mod:`accumlab.hf.logged`.

It checks the property, not the objective's definition: a loss that is wrong the same
way at every split passes. It needs steps whose loss draws no random numbers (dropout
changes with the split) and a window of at least 2 examples. Memory: the job's gradient
held (no copy), the engine's one held copy, one more gradient in ``.grad``; activations of
one microbatch at a time, except the ``(N, 1)`` split, which runs the window's examples
in one forward pass (an out-of-memory error skips it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..invariance import (
    InvarianceReport,
    NotChecked,
    Split,
    SplitMeasure,
    check_splits,
    compare,
    default_splits,
)
from ..invariance.names import name_short, name_split, name_structure
from .capture import CapturedWindow, unwrapped_model
from .generated import COUNT, buffer_settings, generates, share
from .objectives import is_causal_lm, job_targets
from .rows import join_rows, rows_of, slice_rows
from .steps import Replayed, collated, run_split

#: The engine's names as the Trainer audit says them.
RENAME = {"sum_of_means": "num_items_ignored"}


@dataclass
class Invariance:
    """One window checked by split invariance: the engine's report (every measure, each
    split's gradient against the reference's), and for this job as configured its
    ``mistakes`` and their ``evidence``, ``notes`` (a dependence at a split the job does
    not run), ``reason`` when it could not check, what each split would log (``logged``,
    by split) and the job's own gradient norm."""

    configured: Split
    report: InvarianceReport | None = None
    mistakes: list[str] = field(default_factory=list)
    evidence: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    reason: str = ""
    logged: dict[Split, float] = field(default_factory=dict)
    gradient_norm: float = math.nan

    @property
    def splits(self) -> list[SplitMeasure]:
        """Every measure the engine made, in order."""
        return list(self.report.measures) if self.report is not None else []

    @property
    def own(self) -> SplitMeasure | None:
        """The configured split against the reference (None when it is the reference)."""
        return self.report.measure(self.configured) if self.report is not None else None

    @property
    def skipped(self) -> list[str]:
        return list(self.report.skipped) if self.report is not None else []

    @property
    def reference(self) -> Split | None:
        """The split every other was compared with (the first measure's)."""
        against = [m.against for m in self.splits if isinstance(m.against, Split)]
        return against[0] if against else None

    @property
    def examples(self) -> int:
        return self.configured.examples

    @property
    def accumulation_steps(self) -> int:
        return self.configured.accumulation_steps


class _Replay:
    """The engine's ``run(split)`` for one captured window (see the module docstring)."""

    def __init__(self, trainer: Any, model: Any, window: CapturedWindow, tol: float) -> None:
        self.trainer, self.model, self.window, self.tol = trainer, model, window, tol
        self.generated = generates(window)
        self.batches: list[Mapping[str, Any]] = (
            [mb.prepared for mb in window.microbatches]
            if self.generated
            else collated(window) or []
        )
        m = trainer.args.per_device_train_batch_size
        self.sizes = tuple(rows_of(b, m) for b in self.batches)
        self.m = max(self.sizes, default=0)
        self.configured = Split(self.sizes, len(self.sizes)) if all(self.sizes) else None
        self.pad_id = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None) or 0
        self.logged: dict[Split, float] = {}

    def _rows(self, first: int, stop: int) -> Mapping[str, Any] | None:
        """Examples ``first:stop`` of the window as one microbatch (None: cannot join)."""
        pieces, counts, start = [], [], 0
        for batch, n in zip(self.batches, self.sizes, strict=True):
            lo, hi = max(first, start), min(stop, start + n)
            if lo < hi:
                whole = (lo, hi) == (start, start + n)
                pieces.append(batch if whole else slice_rows(batch, lo - start, hi - start, n))
                counts.append(hi - lo)
            start += n
        if len(pieces) == 1:
            return pieces[0]
        return join_rows(pieces, counts, self.pad_id, pad=not self.generated)

    def joins(self) -> bool:
        """Whether the whole window can run as one microbatch."""
        return len(self.batches) == 1 or self._rows(0, sum(self.sizes)) is not None

    def replayed(self, split: Split) -> Replayed:
        batches = []
        for r in split.ranges():
            rows = self._rows(r.start, r.stop)
            if rows is None:
                raise NotChecked(f"the rows of {split.label} cannot be joined into one microbatch")
            batches.append(dict(rows))
        settings: dict[str, Any] = {}
        if self.generated:
            settings, fraction = buffer_settings(
                self.trainer, self.m, split.sizes, split.accumulation_steps
            )
            if fraction is not None:
                for b in batches:
                    if COUNT in b:
                        b[COUNT] = share(b[COUNT], fraction)
        return Replayed(
            max(split.sizes), batches, split.accumulation_steps, settings, self.generated
        )

    def __call__(self, split: Split) -> list[Tensor | None]:
        gradient, logged = run_split(self.trainer, self.model, self.window, self.replayed(split))
        if logged is not None:
            self.logged[split] = logged
        if split == self.configured:  # the replay must be the job's own
            own = [
                None if g is None else g * self.window.factor for g in self.window.gradient or []
            ]
            again = compare(gradient, own)
            if not again.relative_error <= self.tol:
                raise NotChecked(
                    f"replaying the window at its own split {split.label} gives another gradient "
                    f"than the job's (relative error {again.relative_error:.1e}): its steps "
                    "depend on "
                    "something the replay does not repeat"
                )
        return gradient


def _named(report: InvarianceReport, tol: float) -> dict[Split, tuple[str, str]]:
    """The name and evidence each split's own comparison gives (the engine's names)."""
    match = max(10 * tol, 1e-3)
    out: dict[Split, tuple[str, str]] = {}
    dependent = []
    for m in report.measures:
        if m.kind == "split" and m.relative_error > tol:
            found = name_split(m, tolerance=tol, match=match)
            if found:
                out[m.split] = found
            else:
                dependent.append(m)
        elif m.kind == "structure":
            difference = next((d for d in dependent if d.split == m.split), None)
            if difference is not None:
                out[m.split] = name_structure(m, difference, match=match)
        elif m.kind == "short":
            found = name_short(m, tolerance=tol, match=match)
            if found:
                out[m.split] = found
    for m in dependent:  # a structure that ran out of memory
        out.setdefault(m.split, ("depends_on_split", f"{m.line()} (residual {m.residual:.1e})"))
    return out


def _has_short_window(trainer: Any, accumulation: int) -> bool:
    """Whether an epoch of this job ends in a window of fewer than ``A`` microbatches."""
    try:
        return len(trainer.get_train_dataloader()) % accumulation != 0
    except (TypeError, ValueError, NotImplementedError):
        return False


def split_invariance(trainer: Any, model: Any, window: CapturedWindow, tol: float) -> Invariance:
    """Check the window by split invariance (see the module docstring). Call it inside
    :func:`accumlab.hf.state.preserved_trainer`, with the window's gradient held in
    ``window.gradient``; ``model`` is the one ``training_step`` gets."""
    replay = _Replay(trainer, model, window, tol)
    a = len(window.microbatches)
    if not window.microbatches or (not replay.generated and collated(window) is None):
        kind = type(window.microbatches[0].inputs).__name__ if window.microbatches else "no"
        return Invariance(
            Split((1,), 1),
            reason=(
                f"{type(trainer).__name__} trains on {kind} inputs and generates inside its own "
                "training_step without _prepare_inputs: the audit cannot replay its buffer"
            ),
        )
    if replay.configured is None:
        return Invariance(
            Split((1,), 1),
            reason=(
                f"{type(trainer).__name__} hands training_step inputs without per-example "
                "tensors (it "
                "generates inside its own training_step): the audit cannot replay them"
            ),
        )
    configured = replay.configured
    result = Invariance(configured)
    if any(mb.random for mb in window.microbatches):
        result.reason = (
            "the job's steps draw random numbers (dropout, or completions sampled inside "
            "the step), which change with the split: turn dropout off to check that its "
            "gradient does not depend on the split"
        )
        return result
    own = [None if g is None else g * window.factor for g in window.gradient or []]
    result.gradient_norm = compare(own, own).norm
    if result.gradient_norm == 0:
        result.reason = (
            "the job's gradient for this window is zero (no target, or every advantage "
            "zero), so every split agrees: audit a window that has some"
        )
        return result
    splits = default_splits(configured)
    short_here = a > 1 and not replay.generated and _has_short_window(trainer, a)
    if a > 1 and not replay.joins():  # the configured split is the reference
        splits = [configured] + [
            s for s in splits if s.sizes != (configured.examples,) and s != configured
        ]
        result.notes.append(
            f"the window's rows cannot be joined into one microbatch: {configured.label} "
            "is the reference"
        )
    report = check_splits(replay, configured, splits=splits, tolerance=tol)
    result.report, result.logged = report, replay.logged
    if not report.checked:
        result.reason = report.reason
        return result
    spg = getattr(trainer.args, "steps_per_generation", None) if replay.generated else None
    _verdict(result, report, tol, short_here, spg)
    counted = count_check(trainer, model, window, tol)
    if counted:
        result.mistakes.append("count_before_shift")
        result.evidence["count_before_shift"] = counted
    return result


def _verdict(
    result: Invariance, report: InvarianceReport, tol: float, short_here: bool, spg: int | None
) -> None:
    """This run's mistakes and the notes about splits it does not run (see the module
    docstring); ``spg``: a generated buffer's ``steps_per_generation`` (None otherwise)."""
    configured = result.configured
    match = max(10 * tol, 1e-3)
    accumulates = configured.accumulation_steps > 1
    joined = result.reference != configured  # else the window could not run as one microbatch
    for split, (name, evidence) in _named(report, tol).items():
        name = RENAME.get(name, name)
        # with A > 1 the configured split against the whole window decides; where the
        # window cannot run whole, any dependence is this accumulating run's
        ours = accumulates and (split == configured or not joined)
        if split.short:
            ours = short_here
            if not ours:
                result.notes.append(
                    f"a short last window, which this job's epochs do not have: {evidence}"
                )
                continue
        if not ours:
            result.notes.append(
                f"at {split.label}, a split this job does not run ({name}): {evidence}"
            )
            continue
        measure = report.measure(split)
        if spg and measure is not None and spg != configured.accumulation_steps:
            generation = configured.accumulation_steps / spg
            if measure.residual <= match and abs(measure.factor / generation - 1) <= match:
                name = "double_division" if generation < 1 else "wrong_normalization"
                evidence = (
                    f"{measure.line()}, = A / steps_per_generation = "
                    f"{configured.accumulation_steps}/"
                    f"{spg}: each microbatch is divided by the count of the whole generation batch "
                    f"({spg} microbatches), not by this window's share of it"
                )
        if name not in result.evidence:
            result.mistakes.append(name)
            result.evidence[name] = evidence


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
    own = [None if g is None else g * window.factor for g in window.gradient or []]
    replayed = Replayed(
        trainer.args.per_device_train_batch_size,
        [dict(b) for b in batches or []],
        len(batches or []),
    )
    other, _ = run_split(trainer, model, window, replayed, count=targets)
    c = compare(own, other)
    model.zero_grad(set_to_none=True)
    expected = targets / count
    if c.residual > max(tol, 1e-3) or abs(c.factor / expected - 1.0) > max(tol, 1e-3) / 10:
        return ""
    return (
        f"the Trainer's num_items_in_batch is {count:g} where the labels hold {targets:g} targets "
        f"after the shift; with {targets:g} the gradient is {1 / c.factor:.4f} x the job's "
        f"(= {count:g}/{targets:g}): the loss divides by the count"
    )


__all__ = ["RENAME", "Invariance", "count_check", "split_invariance"]
