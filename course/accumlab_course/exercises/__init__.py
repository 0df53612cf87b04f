"""Exercise checkers for the notebooks: ``check(answer)``, ``hint()``, ``solution()``.

Each notebook imports its exercises from a module here, e.g.
``from accumlab_course.exercises import ex01`` then ``ex01.accumulate_from_means.check(fn)``.
A checker runs the learner's answer against a reference on fresh inputs and prints a
one-line verdict; it returns True/False so a notebook cell or a test can act on it.

The committed notebooks ship every exercise unsolved: the learner's cell holds a stub
that raises ``NotImplementedError`` (or a value left as ``...``). ``check`` recognises a
stub and prints a stable "not attempted yet" line that says how to get a hint and the
solution, so a notebook runs top to bottom before anyone has answered.

Two rules hold for every checker, here so that each one gets them:

- a ``None`` gradient counts as zero: a tensor that no loss reached (a microbatch without
  targets that an answer skipped) has ``.grad is None``, which is mathematically a zero
  gradient; compare gradients through :func:`grad_or_zero` / :func:`grads_close`;
- what ``check``, ``hint`` and a prediction's reasoning print is wrapped at :data:`WIDTH`
  characters (:func:`wrap`), so a notebook or the site shows it without scrolling.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any

import torch
from torch import Tensor

#: The verdict printed for a stub; tests and notebooks rely on this exact wording.
NOT_ATTEMPTED = "not attempted yet"

#: The widest line ``check``, ``hint`` and a prediction's reasoning print (characters);
#: ``None`` prints every message on one line.
WIDTH: int | None = 88

#: How continuation lines of a wrapped message are indented.
INDENT = "   "


def wrap(text: str, width: int | None = None, indent: str = INDENT) -> str:
    """``text`` with every line longer than ``width`` (default :data:`WIDTH`) broken at
    spaces, its continuation lines indented by ``indent``. Shorter lines, and so the line
    breaks already in ``text``, are kept; a word longer than ``width`` is never split."""
    width = WIDTH if width is None else width
    if width is None:
        return text
    lines = []
    for line in text.split("\n"):
        if len(line) <= width:
            lines.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        lines += textwrap.wrap(
            line, width=width, subsequent_indent=lead + indent,
            break_long_words=False, break_on_hyphens=False,
        )
    return "\n".join(lines)


def grad_or_zero(tensor: Tensor) -> Tensor:
    """``tensor.grad``, or zeros of its shape when it is ``None``: a tensor no loss reached
    (a microbatch without targets that the answer skipped) has a zero gradient."""
    if tensor.grad is None:
        return torch.zeros_like(tensor)
    return tensor.grad


def grads_close(
    got: Tensor, expected: Tensor, *, rtol: float = 1e-4, atol: float = 1e-7
) -> bool:
    """Whether ``got.grad`` matches ``expected.grad`` (``torch.allclose``), either of them
    ``None`` counting as zero. Compared in float64, so an answer computed in float64 and
    one in float32 are judged by the same tolerance."""
    a, b = grad_or_zero(got).double(), grad_or_zero(expected).double()
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


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
    solution's source text. ``kind`` is ``"exercise"`` (code to write) or ``"prediction"``
    (a number or a choice written down before the cell that computes it runs), whose
    ``answer`` is the value that cell shows."""

    name: str
    checker: Callable[[Any], str | None]
    hints: tuple[str, ...]
    reference: str
    kind: str = "exercise"
    answer: Any = None

    @property
    def path(self) -> str:
        """How a notebook names this exercise, e.g. ``ex01.accumulate_from_means``."""
        return f"{self.checker.__module__.rsplit('.', 1)[-1]}.{self.name}"

    def _not_attempted(self) -> bool:
        print(wrap(
            f"○ {self.name}: {NOT_ATTEMPTED}. Replace the stub above with your answer and run "
            f"this cell again; {self.path}.hint() gives a hint, {self.path}.solution() "
            "shows the answer."
        ))
        return False

    def check(self, answer: Any) -> bool:
        """Print ✓ or ✗ with the reason (○ for a stub), and return whether it passed."""
        if _is_stub(answer):
            return self._not_attempted()
        try:
            problem = self.checker(answer)
        except NotImplementedError:
            return self._not_attempted()
        except Exception as exc:  # a learner's code may fail in any way; report, don't crash
            problem = f"your answer raised {type(exc).__name__}: {exc}"
        if problem is None:
            print(f"✓ {self.name}: correct")
            return True
        print(wrap(f"✗ {self.name}: {problem}"))
        return False

    def hint(self, n: int = 1) -> None:
        """Print the first ``n`` hints."""
        for i, text in enumerate(self.hints[:n], 1):
            print(wrap(f"hint {i}/{len(self.hints)}: {text}"))

    def solution(self) -> None:
        """Print the reference solution."""
        print(self.reference.strip())

    def reveal(self, value: Any, shown: str | None = None) -> None:
        """Show a prediction's answer folded, computed by the cell that calls this.

        ``value`` is what the cell computed; it must be this prediction's answer (the
        checker's rule: a number within its tolerance, a choice by its words), else an
        ``AssertionError`` names both, so the lesson's claim is checked where it is made.
        The answer is displayed as a closed ``<details>`` element whose one visible line
        (the summary) names the question and never the answer; ``shown`` (default: the
        value as written, ``f"{value:g}"`` for a number) is inside it, for the learner to
        open. The plain-text form, what a terminal or a text-only reader gets, holds no
        answer either. The same in JupyterLab (folded or not, after Run All), on the site
        and on GitHub."""
        if self.kind != "prediction":
            raise TypeError(f"{self.path} is an exercise, not a prediction: only a prediction is revealed")
        problem = self.checker(value)
        if problem is not None:
            raise AssertionError(f"{self.path}: the cell computed {value!r}, not the prediction's "
                                 f"answer {self.answer!r}")
        from IPython.display import display

        text = shown if shown is not None else (f"{value:g}" if isinstance(value, (int, float)) else str(value))
        summary = f"Answer to {self.path}: open it once your prediction is written"
        html = (f'<details class="accumlab-answer"><summary>{escape(summary)}</summary>'
                f"<pre>{escape(text)}</pre></details>")
        display({"text/html": html, "text/plain": f"{summary} (folded: open it in the notebook)"},
                raw=True)
