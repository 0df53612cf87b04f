"""The check: run a window's examples at several splits through the job's own code,
compare the gradients, name what differs.

:func:`check_splits` needs one callable from the adapter, ``run(split) -> gradient``
("run the window at this split from the same weights and random state, and give me its
gradient"), and optionally ``objective(split) -> gradient`` (the intended objective's
gradient over the split's examples: the token mean). It runs, holding one gradient at a
time (:class:`~accumlab.invariance.gradients.HeldGradient`):

1. the reference (the first split, ``(N, 1)`` by default) and every other full split over
   the same examples, each compared with the reference;
2. for each full split that differs by no factor of ``A``, its structure: the sum of its
   microbatches' gradients, each run as a window of its own (``A = 1``), then the split
   again, compared with that sum (``average_of_averages`` is ``1/A`` of it);
3. each short window, compared with the same microbatches in a job whose ``A`` is their
   number;
4. the configured split against the objective, when one is given.

Names come from :mod:`~accumlab.invariance.names`. An adapter's ``run`` may raise
:class:`NotChecked` (the job drew random numbers, changed the weights, ...): the report is
then "not checked" with its message. An out-of-memory error skips that split (the
reference too: the next full split becomes the reference). Other exceptions propagate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..mistakes import MISTAKES
from .gradients import Gradient, HeldGradient
from .names import name_objective, name_short, name_split, name_structure
from .report import InvarianceReport, SplitMeasure
from .split import Split, default_splits

#: ``run(split)``: the job's gradient for ``split`` (see the package docstring).
Run = Callable[[Split], Gradient]

#: The relative error within which a check is ok, by the gradients' narrowest dtype.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 3e-2,
}


class NotChecked(Exception):
    """Raised by an adapter's ``run`` to stop the check: its message is the report's
    reason ("the job drew random numbers, ...")."""


def default_tolerance(gradient: Gradient) -> float:
    """:data:`TOLERANCES` of the narrowest floating dtype among ``gradient``'s entries
    (float32's when every entry is None)."""
    found = [TOLERANCES.get(g.dtype, TOLERANCES[torch.float32]) for g in gradient if g is not None]
    return max(found, default=TOLERANCES[torch.float32])


def _check_splits(configured: Split, splits: Sequence[Split] | None) -> list[Split]:
    if not isinstance(configured, Split):
        raise TypeError(f"configured must be a Split (the job's own split), got {type(configured).__name__}")
    if splits is None:
        return default_splits(configured)
    splits = list(splits)
    if not splits or not all(isinstance(s, Split) for s in splits):
        raise TypeError("splits must be a non-empty sequence of Split, the reference first")
    reference = splits[0]
    if reference.short:
        raise ValueError(f"splits[0], the reference, must be a full window, got the short {reference.label}")
    for s in splits[1:]:
        if not s.short and not s.covers_same_examples(reference):
            raise ValueError(
                f"the full split {s.label} covers examples {s.start}..{s.start + s.examples - 1}, "
                f"the reference {reference.label} {reference.start}.."
                f"{reference.start + reference.examples - 1}: a full split must hold the "
                "reference's examples")
    return splits


class _Counter:
    """``run`` counted: how many windows and examples the check ran."""

    def __init__(self, run: Run) -> None:
        self.run, self.windows, self.examples = run, 0, 0

    def __call__(self, split: Split) -> Gradient:
        self.windows += 1
        self.examples += split.examples
        return self.run(split)


def check_splits(
    run: Run,
    configured: Split,
    *,
    splits: Sequence[Split] | None = None,
    objective: Run | None = None,
    objective_name: str = "the token mean",
    tolerance: float | None = None,
    rename: Mapping[str, str] | None = None,
) -> InvarianceReport:
    """Check that the job's gradient for the same examples does not depend on the split.

    ``run(split)`` returns the job's gradient for ``split`` (one tensor or None per trainable
    parameter, in one order; read before the next call, so it may be the parameters'
    ``.grad``), run from the same weights and random state every time, without a step.
    ``configured`` is the job's own split. ``splits`` (default
    :func:`~accumlab.invariance.split.default_splits`) puts the reference first; the other
    full splits hold its examples; a short split is compared with its own microbatches.
    ``objective(split)``, when given, is the intended objective's gradient over the split's
    examples (``objective_name`` names it in the report). ``tolerance``: the relative error
    within which two gradients agree (default :data:`TOLERANCES` by the gradients' dtype).
    ``rename`` maps an engine name to the adapter's own name of the table (the Trainer
    audit calls ``sum_of_means`` ``num_items_ignored``).

    Memory: one copy of the gradient (float32, or float64 for float64 gradients) beside
    what ``run`` holds, and float64 temporaries of one parameter at a time. Returns an
    :class:`~accumlab.invariance.report.InvarianceReport`.
    """
    if not callable(run):
        raise TypeError(f"run must be a callable run(split) -> gradient, got {type(run).__name__}")
    if objective is not None and not callable(objective):
        raise TypeError(f"objective must be a callable objective(split) -> gradient or None, got {type(objective).__name__}")
    for old, new in (rename or {}).items():
        if new not in MISTAKES:
            raise ValueError(f"rename[{old!r}] = {new!r} is not a name of accumlab.mistakes.MISTAKES")
    plan = _check_splits(configured, splits)
    counted = _Counter(run)
    report = InvarianceReport(configured, tolerance if tolerance is not None else 0.0)
    try:
        _check(counted, configured, plan, objective, objective_name, tolerance, report)
    except NotChecked as why:
        report.checked, report.reason = False, str(why)
    found = dict(report.evidence)
    if rename:
        found = {rename.get(k, k): v for k, v in found.items()}
    report.mistakes = [name for name in MISTAKES if name in found]
    report.evidence = {name: found[name] for name in report.mistakes}
    if report.checked and not report.measures:
        report.checked = False
        report.reason = (f"a window of {configured.examples} example"
                         f"{'s' if configured.examples != 1 else ''} cannot be split otherwise: "
                         "give the check at least two examples")
    report.ran = (f"ran: {counted.windows} windows of the job's own code ({counted.examples} "
                  "examples in all), each from the same weights and random state, without a step")
    return report


def _run(run: Run, split: Split, report: InvarianceReport) -> Gradient | None:
    """``run(split)``, or None (noted in ``report.skipped``) when it ran out of memory."""
    try:
        return run(split)
    except torch.OutOfMemoryError:
        report.skipped.append(f"{split.label} ran out of memory")
        return None


def _compare(held: HeldGradient, gradient: Gradient, split: Split, against: Split | str,
             kind: str) -> SplitMeasure:
    c = held.compare(gradient)
    if not c.finite:
        raise NotChecked(f"the gradient at {split.label} or at {against} is not finite (nan or inf)")
    return SplitMeasure(split, against, c.factor, c.relative_error, c.residual, kind)


def _check(run: Run, configured: Split, plan: list[Split], objective: Run | None,
           objective_name: str, tolerance: float | None, report: InvarianceReport) -> None:
    held = HeldGradient()
    full = [s for s in plan if not s.short]
    short = [s for s in plan if s.short]
    reference: Split | None = None
    for s in full:  # the first full split that fits in memory is the reference
        gradient = _run(run, s, report)
        if gradient is not None:
            reference = s
            held.set(gradient)
            break
    if reference is None:
        raise NotChecked("no full split fitted in memory")
    if held.compare(gradient).held_norm == 0.0:
        raise NotChecked(
            f"the gradient at {reference.label} is zero: nothing reached it (no backward pass, "
            "every parameter frozen, or a framework that keeps the gradient elsewhere, such as "
            "DeepSpeed's ZeRO partitions)")
    tol = tolerance if tolerance is not None else default_tolerance(gradient)
    report.tolerance = tol
    match = max(10 * tol, 1e-3)
    del gradient

    dependent: list[SplitMeasure] = []
    for s in full[full.index(reference) + 1:]:
        gradient = _run(run, s, report)
        if gradient is None:
            continue
        m = _compare(held, gradient, s, reference, "split")
        report.measures.append(m)
        found = name_split(m, tolerance=tol, match=match)
        if found:
            report.evidence.setdefault(*found)
        elif m.relative_error > tol:
            dependent.append(m)
        del gradient

    for m in dependent:  # 2. the structure of each dependence no factor explains
        held.zero()
        for alone in m.split.alone():
            gradient = _run(run, alone, report)
            if gradient is None:
                raise NotChecked(f"a microbatch of {m.split.label} run alone ran out of memory")
            held.add(gradient)
            del gradient
        gradient = _run(run, m.split, report)
        if gradient is None:
            continue
        s = _compare(held, gradient, m.split,
                     f"the sum of its {m.split.microbatches} microbatches run alone", "structure")
        report.measures.append(s)
        report.evidence.setdefault(*name_structure(s, m, match=match))
        del gradient

    for s in short:  # 3. each short window against its own microbatches with A = their number
        gradient = _run(run, s.full(), report)
        if gradient is None:
            continue
        held.set(gradient)
        gradient = _run(run, s, report)
        if gradient is None:
            continue
        m = _compare(held, gradient, s, s.full(), "short")
        report.measures.append(m)
        found = name_short(m, tolerance=tol, match=match)
        explained = found and found[0] == "short_window_divided_by_a" and "double_division" in report.evidence
        if found and not explained:
            report.evidence.setdefault(*found)
        del gradient

    if objective is not None:  # 4. the configured split against the intended objective
        target = configured.full() if configured.short else configured
        gradient = objective(target)
        held.set(gradient)
        del gradient
        gradient = _run(run, target, report)
        if gradient is not None:
            m = _compare(held, gradient, target, objective_name, "objective")
            report.measures.append(m)
            found = name_objective(m, tolerance=tol, match=match)
            if found and not report.evidence:
                report.evidence.setdefault(*found)


__all__ = ["NotChecked", "Run", "TOLERANCES", "check_splits", "default_tolerance"]
