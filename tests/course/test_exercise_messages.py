"""The checkers' shared rules: messages wrapped for a narrow column, None gradients as zero."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accumlab_course.exercises as exercises
from accumlab_course.exercises import (
    Exercise,
    ex00,
    ex01,
    ex02,
    ex03,
    grad_or_zero,
    grads_close,
    wrap,
)

MINE = (ex00, ex01, ex02, ex03)  # the notebooks whose solutions must fit the column too


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> int:
    """Messages wrapped as the notebooks print them (conftest turns it off elsewhere)."""
    monkeypatch.setattr(exercises, "WIDTH", 88)
    return 88


def test_wrap_breaks_long_lines_at_spaces_and_keeps_every_word() -> None:
    text = "✗ name: " + " ".join(f"word{i}" for i in range(60)) + "\nshort line\n  code(x)"
    out = wrap(text, 40)
    assert all(len(line) <= 40 for line in out.splitlines())
    assert out.split() == text.split()  # nothing lost, nothing split inside a word
    assert out.splitlines()[1].startswith("   word")  # continuation indented
    assert out.endswith("\nshort line\n  code(x)")  # short lines kept as they are
    assert wrap("x" * 50, 40) == "x" * 50  # a long word is never cut


def test_wrap_follows_width_and_none_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "a " * 100
    monkeypatch.setattr(exercises, "WIDTH", None)
    assert wrap(text) == text
    monkeypatch.setattr(exercises, "WIDTH", 30)
    assert max(len(line) for line in wrap(text).splitlines()) <= 30


def _long_problem(answer: Any) -> str:
    return "the value is wrong because " + "of a long explanation " * 12


def test_check_hint_and_not_attempted_lines_fit(wrapped: int, capsys: Any) -> None:
    exercise = Exercise("long_one", _long_problem, ("a hint " * 30,), "x = 1")
    assert exercise.check(lambda: None) is False
    assert exercise.check(...) is False
    exercise.hint()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("✗ long_one: the value is wrong")
    assert any(line.startswith("○ long_one: not attempted yet") for line in lines)
    assert len(lines) > 6 and all(len(line) <= wrapped for line in lines), lines


@pytest.mark.parametrize("module", MINE, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_hint_stub_line_and_solution_of_00_to_03_fits(
    module: Any, wrapped: int, capsys: Any
) -> None:
    found = [e for e in vars(module).values() if isinstance(e, Exercise)]
    assert found
    for exercise in found:
        exercise.hint(len(exercise.hints))
        exercise.check(...)
        exercise.solution()
    lines = capsys.readouterr().out.splitlines()
    too_long = [line for line in lines if len(line) > wrapped]
    assert not too_long, too_long


def test_a_none_gradient_counts_as_zero() -> None:
    reached = torch.zeros(3, requires_grad=True)
    untouched = torch.zeros(3, requires_grad=True)
    (reached * 0.0).sum().backward()
    assert untouched.grad is None and torch.equal(grad_or_zero(untouched), torch.zeros(3))
    assert grads_close(untouched, reached) and grads_close(reached, untouched)
    (reached * 2.0).sum().backward()
    assert not grads_close(untouched, reached)
    double = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    (double * 2.0).sum().backward()
    assert grads_close(double, reached)  # float64 and float32 judged alike
