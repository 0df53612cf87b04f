"""Tests a team keeps: one assertion that its job's update does not depend on the split, or
that it is the token mean, failing with the check's report.

.. code-block:: python

    from accumlab.testing import assert_split_invariant

    def test_our_update_does_not_depend_on_the_split():
        assert_split_invariant(model, examples, collate, our_window,
                               micro_batch_size=2, accumulation_steps=4)

Each helper runs :func:`accumlab.split_invariance` on the team's own model, examples,
collate function and window code (forward and backward for a list of microbatches, no
step) and raises ``AssertionError`` with the report's text when the check is not ok, or
could not run (a check that did not run is no pass). It returns the report otherwise.
:func:`assert_checked_ok` does the same for a report made elsewhere (a Lightning
callback's ``callback.report``). Plain functions, not a pytest plugin: nothing is loaded
into a test run that does not import this module, and it imports no test framework.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .invariance import InvarianceReport, Split, split_invariance
from .invariance.plain import Window
from .objectives import NextTokenLoss, Objective


def assert_checked_ok(report: InvarianceReport | None) -> InvarianceReport:
    """``report`` when it was checked and is ok; else ``AssertionError`` with its text (or
    saying there is no report, as when a callback never reached its first step)."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    if report is None:
        raise AssertionError("no split-invariance report: the check never ran (did the run "
                             "reach its first optimizer step?)")
    if not isinstance(report, InvarianceReport):
        raise TypeError(f"report must be an InvarianceReport, got {type(report).__name__}")
    if not report.ok:
        raise AssertionError(report.text())
    return report


def assert_split_invariant(
    model: nn.Module,
    examples: Sequence[Any],
    collate: Callable[[list[Any]], Any],
    window: Window,
    *,
    micro_batch_size: int,
    accumulation_steps: int,
    splits: Sequence[Split] | None = None,
    tolerance: float | None = None,
) -> InvarianceReport:
    """Assert that the job's gradient for the same examples is the same at every split
    (:func:`accumlab.split_invariance`, the same arguments); the report when it is."""
    __tracebackhide__ = True
    return assert_checked_ok(split_invariance(
        model, examples, collate, window, micro_batch_size=micro_batch_size,
        accumulation_steps=accumulation_steps, splits=splits, tolerance=tolerance))


def assert_token_mean(
    model: nn.Module,
    examples: Sequence[Any],
    collate: Callable[[list[Any]], Any],
    window: Window,
    *,
    micro_batch_size: int,
    accumulation_steps: int,
    objective: Objective | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    splits: Sequence[Split] | None = None,
    tolerance: float | None = None,
) -> InvarianceReport:
    """Assert that the job's gradient does not depend on the split *and* is the objective's
    window mean: by default the token mean of a causal LM
    (:class:`accumlab.NextTokenLoss`, the labels shifted, -100 ignored), called on
    ``forward(model, microbatch)`` (by default ``model(**microbatch)`` without labels)."""
    __tracebackhide__ = True
    return assert_checked_ok(split_invariance(
        model, examples, collate, window, micro_batch_size=micro_batch_size,
        accumulation_steps=accumulation_steps, splits=splits, tolerance=tolerance,
        objective=objective if objective is not None else NextTokenLoss(), forward=forward))


__all__ = ["assert_checked_ok", "assert_split_invariant", "assert_token_mean"]
