"""Exercise checkers for the notebooks: ``check(answer)``, ``hint()``, ``solution()``.

Each notebook imports its exercises from a module here, e.g.
``from accumlab.course.exercises import ex01`` then ``ex01.accumulate_from_means.check(fn)``.
A checker runs the learner's answer against a reference on fresh inputs and prints a
one-line verdict; it returns True/False so a notebook cell or a test can act on it.

The committed notebooks ship every exercise unsolved: the learner's cell holds a stub
that raises ``NotImplementedError`` (or a value left as ``...``). ``check`` recognises a
stub and prints a stable "not attempted yet" line that says how to get a hint and the
solution, so a notebook runs top to bottom before anyone has answered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: The verdict printed for a stub; tests and notebooks rely on this exact wording.
NOT_ATTEMPTED = "not attempted yet"


def fills_grad_only(model: Any, weights_before: dict[str, Any], where: str) -> str | None:
    """The problem with an answer that should only fill ``.grad``: it changed the weights,
    or it left no gradient at all (``None`` when neither)."""
    if any(not torch.equal(weights_before[k], v) for k, v in model.state_dict().items()):
        return (
            f"{where}: the weights changed; this function only fills .grad, the "
            "optimizer steps after the window"
        )
    if all(p.grad is None for p in model.parameters()):
        return f"{where}: no gradient at all; call .backward() on each microbatch's loss"
    return None


def _is_stub(answer: Any) -> bool:
    return answer is None or answer is Ellipsis


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``checker(answer)`` returns ``None`` when the answer is right, or a
    message saying what is wrong; ``hints`` are shown one at a time; ``reference`` is the
    solution's source text."""

    name: str
    checker: Callable[[Any], str | None]
    hints: tuple[str, ...]
    reference: str

    @property
    def path(self) -> str:
        """How a notebook names this exercise, e.g. ``ex01.accumulate_from_means``."""
        return f"{self.checker.__module__.rsplit('.', 1)[-1]}.{self.name}"

    def _not_attempted(self) -> bool:
        print(
            f"⏳ {self.name}: {NOT_ATTEMPTED}. Replace the stub above with your answer and run "
            f"this cell again; {self.path}.hint() gives a hint, {self.path}.solution() "
            "shows the answer."
        )
        return False

    def check(self, answer: Any) -> bool:
        """Print ✅ or ❌ with the reason (⏳ for a stub), and return whether it passed."""
        if _is_stub(answer):
            return self._not_attempted()
        try:
            problem = self.checker(answer)
        except NotImplementedError:
            return self._not_attempted()
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
