"""Predict-first questions: before a cell runs, the learner writes down a number or a choice.

A notebook cell holds ``my_prediction = ...`` (a stub) and ``exNN.<name>.check(my_prediction)``;
the checker compares the prediction with the value the next cell computes (the same value,
fixed here and asserted there), says "not attempted yet" while the stub is ``...``, and
names the usual wrong prediction when it recognises one. ``solution()`` prints the
reasoning. Each question is an :class:`~accumlab_course.exercises.Exercise`, so ``hint``,
``solution`` and the notebook rules are the same as for code exercises.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from . import Exercise, wrap


def _normal(text: str) -> str:
    return " ".join(text.lower().replace("-", " ").split())


def number_prediction(
    module: str,
    name: str,
    expected: float,
    *,
    what: str,
    mistakes: Mapping[float, str],
    hints: Sequence[str],
    reasoning: str,
    rel_tol: float = 1e-3,
) -> Exercise:
    """A question whose answer is a number: ``expected`` (``what`` says what it counts, with
    its unit), within ``rel_tol``; ``mistakes`` maps a known wrong number to what it means.
    ``module`` is the calling module's ``__name__``, so the notebook's ``exNN.<name>`` path
    shows in the "not attempted yet" line."""

    def check(answer: object) -> str | None:
        if isinstance(answer, bool) or not isinstance(answer, (int, float)):
            return f"write your prediction as a number ({what}), got {type(answer).__name__}"
        if math.isclose(answer, expected, rel_tol=rel_tol, abs_tol=1e-12):
            return None
        for wrong, meaning in mistakes.items():
            if math.isclose(answer, wrong, rel_tol=rel_tol, abs_tol=1e-12):
                return f"{answer:g} is {meaning}; run the next cell and see"
        return f"not {answer:g}; run the next cell and see ({what})"

    check.__module__ = module
    check.__name__ = f"check_{name}"
    reference = f"{wrap(reasoning)}\nanswer: {expected:g}"
    return Exercise(name, check, tuple(hints), reference, kind="prediction", answer=expected)


def choice_prediction(
    module: str,
    name: str,
    expected: str,
    *,
    choices: Sequence[str],
    mistakes: Mapping[str, str],
    hints: Sequence[str],
    reasoning: str,
) -> Exercise:
    """A question whose answer is one of ``choices`` (text, compared ignoring case, extra
    spaces and hyphens); ``mistakes`` maps a wrong choice to what it overlooks."""
    normal = {_normal(c): c for c in choices}
    if _normal(expected) not in normal:
        raise ValueError(f"expected={expected!r} must be one of choices={list(choices)}")

    def check(answer: object) -> str | None:
        options = " | ".join(repr(c) for c in choices)
        if not isinstance(answer, str) or _normal(answer) not in normal:
            return f"write one of {options} as a string, got {answer!r}"
        chosen = normal[_normal(answer)]
        if chosen == expected:
            return None
        reason = mistakes.get(chosen, "not what the next cell shows")
        return f"{chosen!r}: {reason}; run the next cell and see"

    check.__module__ = module
    check.__name__ = f"check_{name}"
    reference = f"{wrap(reasoning)}\nanswer: {expected!r}"
    return Exercise(name, check, tuple(hints), reference, kind="prediction", answer=expected)
