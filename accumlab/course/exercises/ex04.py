"""Exercises for notebook 04 (data parallelism).

- ``padding_plan``: write ``padding_plan(microbatches_per_rank, accumulation_steps) ->
  list[list[int]]``. Rank ``r`` has ``microbatches_per_rank[r]`` microbatches in its
  loader and groups them into windows of ``accumulation_steps``; its last window may be
  short and is trained on (``last_window="update"``). Return, for every rank, the number
  of zero-target padding microbatches it must add to each update attempt so that every
  rank makes the same number of attempts with the same number of microbatches in each
  (and therefore synchronizes at the same index), adding as few as possible. Every rank
  has at least one microbatch.

The checker compares the answer with :func:`accumlab.distributed.window_lengths` on fixed
and random cases and names the usual mistakes: ranks that stop early, padding every
window up to ``A``, padding counted from the wrong side.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from typing import Any

from ...distributed import trained_lengths, window_lengths
from ...plan import AccumulationPlan
from . import Exercise


def reference_padding_plan(
    microbatches_per_rank: Sequence[int], accumulation_steps: int
) -> list[list[int]]:
    """Padding microbatches per rank and update attempt, with as few as possible."""
    a = accumulation_steps
    # each rank's own windows: full ones of A, then the remainder, if any
    own = [[a] * (n // a) + ([n % a] if n % a else []) for n in microbatches_per_rank]
    attempts = max(len(lengths) for lengths in own)  # the rank with the most windows decides
    target = [max(ls[i] if i < len(ls) else 0 for ls in own) for i in range(attempts)]
    return [[t - (ls[i] if i < len(ls) else 0) for i, t in enumerate(target)] for ls in own]


def _expected(counts: Sequence[int], steps: int) -> list[list[int]]:
    plan = AccumulationPlan(1, steps)
    target = window_lengths(counts, plan)
    out = []
    for n in counts:
        own = trained_lengths(n, plan)
        out.append([t - (own[i] if i < len(own) else 0) for i, t in enumerate(target)])
    return out


def _cases() -> list[tuple[list[int], int]]:
    fixed = [([7, 5], 3), ([6, 6], 3), ([2, 9], 3), ([8, 8], 4), ([1, 1, 5], 2), ([13, 4, 9, 9], 4)]
    rng = random.Random(4)
    for _ in range(40):
        ranks = rng.randint(2, 5)
        steps = rng.randint(1, 6)
        fixed.append(([rng.randint(1, 20) for _ in range(ranks)], steps))
    return fixed


def _diagnose(got: list[list[int]], counts: Sequence[int], steps: int) -> str | None:
    lengths = {len(row) for row in got}
    if len(lengths) > 1:
        return (
            f"the ranks make different numbers of update attempts ({[len(r) for r in got]}); a "
            "rank that runs out of windows must still join every remaining attempt with "
            "padding microbatches, or its peers wait forever in a collective"
        )
    if any(x < 0 for row in got for x in row):
        return "a padding count is negative: pad the ranks that have fewer microbatches, never remove"
    plan = AccumulationPlan(1, steps)
    per_rank = [trained_lengths(n, plan) for n in counts]
    padded_to_a = [
        [steps - (own[i] if i < len(own) else 0) for i in range(len(window_lengths(counts, plan)))]
        for own in per_rank
    ]
    if got == padded_to_a:
        return (
            "every window is padded up to A; pad only up to the most any rank has in that "
            "window (when every rank's last window is short, nobody needs to fill it)"
        )
    return None


def check_padding_plan(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` returns the minimal aligned padding on every case, else why not."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    for counts, steps in _cases():
        expected = _expected(counts, steps)
        got = answer(list(counts), steps)
        where = f"for microbatches_per_rank={counts}, accumulation_steps={steps}"
        try:
            got = [[int(x) for x in row] for row in got]
        except TypeError:
            return f"{where}: expected a list of lists of ints (one list per rank), got {got!r}"
        if len(got) != len(counts):
            return f"{where}: expected one list per rank ({len(counts)}), got {len(got)}"
        if got == expected:
            continue
        mistake = _diagnose(got, counts, steps)
        return f"{where}: {mistake or f'expected {expected}, got {got}'}"
    return None


padding_plan = Exercise(
    name="padding_plan",
    checker=check_padding_plan,
    hints=(
        "First write down each rank's own window lengths: n // A full windows of A, then "
        "one of n % A if that is not zero.",
        "Every rank makes as many update attempts as the rank with the most windows; in "
        "attempt i every rank runs the most microbatches any rank has in its window i "
        "(0 for a rank with no window i).",
        "A rank's padding in attempt i is that target minus its own length there.",
    ),
    reference=inspect.getsource(reference_padding_plan),
)
