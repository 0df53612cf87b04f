"""Exercise checkers for the notebooks: ``check(answer)``, ``hint()``, ``solution()``.

Each notebook imports its exercises from a module here, e.g.
``from accumlab.exercises import ex01`` then ``ex01.window_loss.check(my_function)``.
A checker runs the learner's answer against a reference on fresh inputs and prints a
one-line verdict; it returns True/False so a notebook cell can ``assert`` on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``checker(answer)`` returns ``None`` when the answer is right, or a
    message saying what is wrong; ``hints`` are shown one at a time; ``reference`` is the
    solution's source text."""

    name: str
    checker: Callable[[Any], str | None]
    hints: tuple[str, ...]
    reference: str

    def check(self, answer: Any) -> bool:
        """Print ✅ or ❌ with the reason, and return whether the answer passed."""
        try:
            problem = self.checker(answer)
        except Exception as exc:  # a learner's code may fail in any way; report, don't crash
            problem = f"your answer raised {type(exc).__name__}: {exc}"
        if problem is None:
            print(f"✅ {self.name}: correct")
            return True
        print(f"❌ {self.name}: {problem}")
        return False

    def hint(self, n: int = 1) -> None:
        """Print the first ``n`` hints."""
        for i, text in enumerate(self.hints[:n], 1):
            print(f"hint {i}/{len(self.hints)}: {text}")

    def solution(self) -> None:
        """Print the reference solution."""
        print(self.reference.strip())
