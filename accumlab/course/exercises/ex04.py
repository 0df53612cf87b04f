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

- ``ddp_window``: write one update from one window under DDP by hand,
  ``ddp_window(model, window, optimizer, objective) -> None``. ``model`` is wrapped in
  ``DistributedDataParallel``, ``window`` is this rank's list of microbatches (CPU dicts
  with ``input_ids`` and ``labels``), ``objective`` a ``NextTokenLoss``. Clear the
  gradients, sum the window's target count over all ranks (one all-reduce), backpropagate
  every microbatch's ``loss_sum × D / global_count`` with ``no_sync`` around the forward
  and the backward of all but the last microbatch, step once.

The checker launches two gloo ranks (about ten seconds) with uneven data, runs the
answer for two windows on a DDP model whose communication hook counts the gradient
synchronizations and an optimizer that records the gradient it is handed, and compares
each window's gradient with the single-process token mean over both ranks' examples. It
names the usual mistakes: no ``× D`` (half the gradient on two ranks), a per-rank count
(the average of averages), ``no_sync`` missing or around the backward only (``A``
synchronizations per window), the last microbatch inside ``no_sync`` (none), a step per
microbatch, gradients carried into the next window.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import random
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...checks import compare
from ...distributed import launch, trained_lengths, window_lengths
from ...plan import AccumulationPlan
from .. import workers
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
        return (
            "a padding count is negative: pad the ranks that have fewer microbatches, never remove"
        )
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


# ----------------------------------------------------------------------------- ddp_window


def reference_ddp_window(model, window, optimizer, objective):
    """One update from this rank's ``window`` under DDP."""
    optimizer.zero_grad(set_to_none=True)
    world = dist.get_world_size()  # D
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count, op=dist.ReduceOp.SUM)  # the window's targets over all ranks
    for i, mb in enumerate(window):
        last = i == len(window) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # forward AND backward
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) * world / count).backward()  # × D: DDP averages
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


#: Relative tolerance on a window's gradient against the single-process full batch.
DDP_RTOL = 1e-5
#: Windows of ``A`` microbatches of ``M`` examples per rank that the checker runs.
M, A, WINDOWS = 2, 2, 2


def _references() -> list[dict[str, dict[str, Tensor]]]:
    """Per window: the right gradient and the two usual wrong ones, at the initial weights."""
    per_rank = workers.uneven_examples(2)
    per_window = M * A
    out = []
    for w in range(WINDOWS):
        parts = [exs[w * per_window : (w + 1) * per_window] for exs in per_rank]
        right = workers.token_mean_gradient(workers.small_model(), [e for p in parts for e in p])
        means = [workers.token_mean_gradient(workers.small_model(), p) for p in parts]
        out.append(
            {
                "right": right,
                "no × D": {k: v / 2 for k, v in right.items()},
                "local count": {k: (means[0][k] + means[1][k]) / 2 for k in right},
            }
        )
    return out


def _close(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    return compare(a, b).max_rel_error <= DDP_RTOL


def _diagnose_window(results: list[dict[str, Any]], references: list[dict[str, Any]]) -> str | None:
    """What is wrong with the answer's run (both ranks' results), or None."""
    rank0, rank1 = results
    for w in range(WINDOWS):
        steps, syncs = rank0["steps"][w], rank0["syncs"][w]
        if steps == 0:
            return f"window {w}: optimizer.step() was never called; step once after the last microbatch"
        if steps > 1:
            return (
                f"window {w}: optimizer.step() ran {steps} times; step once per window, after "
                "the last microbatch (A backward passes feed one update)"
            )
        if syncs == A:
            return (
                f"{A} gradient synchronizations in a window of {A} microbatches, expected 1: "
                "put every microbatch but the last inside model.no_sync(), forward AND "
                "backward (DDP decides at forward time, so no_sync around the backward "
                "alone does nothing)"
            )
        if syncs == 0:
            return (
                "no gradient synchronization at all: the last microbatch must run outside "
                "no_sync, so its backward all-reduces the accumulated gradient"
            )
        if syncs != 1:
            return f"{syncs} gradient synchronizations in window {w}, expected exactly 1"
    for w in range(WINDOWS):
        got, ref = rank0["seen"][w], references[w]
        if _close(ref["right"], got):
            continue
        if w > 0 and _close({k: ref["right"][k] + references[w - 1]["right"][k] for k in got}, got):
            return (
                f"window {w}'s gradient still holds window {w - 1}'s: clear the gradients "
                "(optimizer.zero_grad()) before the window's first backward"
            )
        if _close(ref["no × D"], got):
            return (
                "the gradient is 1/2 of the full batch's with 2 ranks: DDP averages over the "
                "D ranks, so multiply each loss_sum by D (dist.get_world_size()) / global count"
            )
        if _close(ref["local count"], got):
            return (
                "each rank divided by its own target count, and DDP averaged the two means "
                "(the average of averages): all-reduce the count so every rank divides by the "
                "window's targets over all ranks"
            )
        error = compare(ref["right"], got).max_rel_error
        return (
            f"window {w}: the gradient differs from the single-process full batch over both "
            f"ranks (max relative error {error:.2g}); backpropagate loss_sum × D / global count"
        )
    if any(rank0["grads_left"]) or any(rank1["grads_left"]):
        return "gradients are left after the update; clear them after optimizer.step()"
    return None


def _run(answers: Sequence[Callable[..., Any]]) -> list[list[dict[str, Any]] | str]:
    """Launch two gloo ranks once and run every answer there (rank 0 and 1's results per
    answer, or the error it raised)."""
    sources = []
    for answer in answers:
        try:
            sources.append((textwrap.dedent(inspect.getsource(answer)), answer.__name__))
        except (OSError, TypeError):
            sources.append(None)
    runnable = [s for s in sources if s is not None]
    try:
        per_rank = launch(workers.run_window_answers, 2, (runnable, M, A, WINDOWS), deadline_s=180)
    except Exception as exc:  # the learner's code failed on a rank: report it
        return [f"your answer raised {type(exc).__name__}: {str(exc).splitlines()[0]}"] * len(
            answers
        )
    out: list[list[dict[str, Any]] | str] = []
    k = 0
    for s in sources:
        if s is None:
            out.append("define your answer with def in a cell (its source is sent to the ranks)")
            continue
        pair = [per_rank[0][k], per_rank[1][k]]
        k += 1
        error = next((r["error"] for r in pair if r.get("error")), None)
        out.append(f"your answer raised {error}" if error else pair)
    return out


def diagnose_ddp_windows(answers: Sequence[Callable[..., Any]]) -> list[str | None]:
    """Check several answers with one launch (what the tests use); None for a right one."""
    references = _references()
    verdicts: list[str | None] = []
    for result in _run(answers):
        verdicts.append(result if isinstance(result, str) else _diagnose_window(result, references))
    return verdicts


def _is_stub(answer: Callable[..., Any]) -> bool:
    """Whether the function's body does nothing but ``raise NotImplementedError``, ``...``
    or ``pass`` (a docstring aside): then there is nothing to launch ranks for."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(answer)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and hasattr(tree.body[0], "body") else []
    body = [
        node
        for node in body
        if not (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        )
    ]

    def empty(node: ast.stmt) -> bool:
        if isinstance(node, ast.Pass):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return node.value.value is Ellipsis
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
        return False

    return len(body) == 1 and empty(body[0])


def check_ddp_window(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` makes the full-batch update with one sync per window, else why
    not. A stub raises ``NotImplementedError`` here, before any rank is launched."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    if _is_stub(answer):
        raise NotImplementedError
    verdict = diagnose_ddp_windows([answer])[0]
    if verdict is not None and verdict.startswith("your answer raised NotImplementedError"):
        raise NotImplementedError
    return verdict


ddp_window = Exercise(
    name="ddp_window",
    checker=check_ddp_window,
    hints=(
        "Start with optimizer.zero_grad(); count the window's targets on the CPU, put them "
        "in a tensor and dist.all_reduce it (a sum over ranks).",
        "For every microbatch but the last: with model.no_sync(): forward AND backward. "
        "The last one runs outside, so its backward synchronizes once.",
        "Backpropagate objective.loss_sum(logits, mb) * dist.get_world_size() / count: DDP "
        "divides the summed gradient by D, the × D cancels it. Then optimizer.step() once.",
    ),
    reference=inspect.getsource(reference_ddp_window),
)
