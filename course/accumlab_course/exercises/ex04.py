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

- ``uneven_window`` (transfer): write one update attempt from one window under DDP when
  some ranks have no targets, ``uneven_window(model, window, optimizer, objective) ->
  float``. ``model`` is wrapped in ``DistributedDataParallel`` (call it as
  ``model(input_ids=mb["input_ids"])``), ``window`` is this rank's list of
  microbatches (CPU dicts with ``input_ids`` and ``labels``), ``objective`` a
  ``NextTokenLoss`` (``objective.count(mb)``, ``objective.loss_sum(output, mb)`` with the
  model's output). Some of a
  rank's windows have no targets (every label -100), and one window has none on any rank.
  A window with targets somewhere must give the single-process token mean over every
  rank's targets with one gradient sync, and the function returns that window's loss: the
  mean per target over **all** ranks' targets, a Python float, the same on every rank
  (the log line a run prints). A window without targets anywhere makes no update and
  returns ``float("nan")`` (``None`` is accepted). Clear the gradients before the first
  backward and after the step.

The checker launches two gloo ranks (about ten seconds) with uneven data for three
windows: both ranks with targets; rank 0 without; no rank with any. A DDP communication
hook counts the gradient synchronizations and an optimizer records the gradient it is
handed; each window's gradient is compared with the single-process token mean over both
ranks' targets. It names the usual mistakes: no ``× D`` (half the gradient on two ranks),
a per-rank count (the average of averages), a rank
without targets that skips its backward (its peer's all-reduce has no partner), an update
or a division by zero in the window without targets, ``no_sync`` missing or around the
backward only (``A`` synchronizations per window), the last microbatch inside ``no_sync``
(none), a step per microbatch, gradients carried into the next window.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
import random
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from accumlab.checks import compare
from accumlab.distributed import launch, trained_lengths, window_lengths
from accumlab.plan import AccumulationPlan

from .. import workers
from . import Exercise
from .predictions import number_prediction


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


# ----------------------------------------------------------------------------- uneven_window


def reference_uneven_window(model, window, optimizer, objective):
    """One update attempt from this rank's ``window`` under DDP; returns the window's mean
    loss per target over all ranks (NaN, and no update, when no rank has a target)."""
    optimizer.zero_grad(set_to_none=True)
    world = dist.get_world_size()  # D
    count = torch.tensor(sum(objective.count(mb) for mb in window))  # on the CPU
    dist.all_reduce(count, op=dist.ReduceOp.SUM)  # the window's targets over all ranks
    if count == 0:  # the same answer on every rank: all of them skip together
        return float("nan")
    logged = torch.zeros(())
    for i, mb in enumerate(window):  # every rank runs every microbatch, targets or not
        last = i == len(window) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # the forward decides
            output = model(input_ids=mb["input_ids"])
            loss_sum = objective.loss_sum(output, mb)
            (loss_sum * world / count).backward()  # × D: DDP averages the gradients
        logged += loss_sum.detach()  # this rank's sum, no graph
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(logged, op=dist.ReduceOp.SUM)  # every rank joins, with or without targets
    return float(logged) / int(count)  # the log line: one read per window


#: Relative tolerance on a window's gradient against the single-process full batch.
DDP_RTOL = 1e-5
#: ``A`` microbatches of ``M`` examples per rank and window; which ranks have no targets.
M, A, NO_TARGETS = 2, 2, workers.NO_TARGETS
#: Which windows make an update (targets on some rank).
APPLIED = [any(r not in empty for r in range(2)) for empty in NO_TARGETS]


def _token_mean_loss(examples: Sequence[Any]) -> float:
    """The token-mean loss of ``examples`` as one batch, at the initial weights."""
    from ..data import collate

    batch = collate(list(examples))
    with torch.no_grad():
        logits = workers.small_model()(input_ids=batch["input_ids"]).logits
        return float(torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
            batch["labels"][:, 1:].reshape(-1), ignore_index=-100))


def _references() -> list[dict[str, dict[str, Tensor]] | None]:
    """Per window with targets: the right gradient and the usual wrong ones, at the
    initial weights (None for the window without targets)."""
    out: list[dict[str, dict[str, Tensor]] | None] = []
    for w, empty in enumerate(NO_TARGETS):
        parts = [[] if r in empty else workers.window_examples(r, 2, w, M, A) for r in range(2)]
        if not any(parts):
            out.append(None)
            continue
        right = workers.token_mean_gradient(workers.small_model(), [e for p in parts for e in p])
        wrong = {"right": right, "no × D": {k: v / 2 for k, v in right.items()}}
        wrong["loss"] = _token_mean_loss([e for p in parts for e in p])  # type: ignore[assignment]
        wrong["local losses"] = [_token_mean_loss(p) if p else None for p in parts]  # type: ignore[assignment]
        if all(parts):
            means = [workers.token_mean_gradient(workers.small_model(), p) for p in parts]
            wrong["local count"] = {k: (means[0][k] + means[1][k]) / 2 for k in right}
        out.append(wrong)
    return out


def _close(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    return compare(a, b).max_rel_error <= DDP_RTOL


def _diagnose_counts(results: list[dict[str, Any]]) -> str | None:
    """Mistakes visible in the counted syncs and steps of both ranks, or None."""
    for w, empty in enumerate(NO_TARGETS):
        nothing_anywhere = len(empty) == 2
        for rank, result in enumerate(results):
            steps, syncs = result["steps"][w], result["syncs"][w]
            if nothing_anywhere:
                if steps:
                    return (
                        f"window {w} has no targets on any rank, yet optimizer.step() ran: "
                        "when the all-reduced count is 0, return float('nan') before any "
                        "forward (dividing by it gives nan)"
                    )
                if syncs:
                    return (
                        f"window {w} has no targets on any rank, yet it ran forward and "
                        "backward passes: return float('nan') as soon as the all-reduced "
                        "count is 0"
                    )
                continue
            if rank in empty and syncs == 0 and results[1 - rank]["syncs"][w] > 0:
                return (
                    f"window {w}: rank {rank} has no targets and ran no backward, so its peer's "
                    "gradient all-reduce had no partner: a rank without targets still runs "
                    "every forward and backward (its loss is 0), as a padding microbatch does"
                )
            if steps == 0:
                return (
                    f"window {w}: optimizer.step() was never called on rank {rank}; step "
                    "once after the last microbatch when the window has targets somewhere"
                )
            if steps > 1:
                return (
                    f"window {w}: optimizer.step() ran {steps} times; step once per window, "
                    f"after the last microbatch ({A} backward passes feed one update)"
                )
            if syncs == A:
                return (
                    f"{A} gradient synchronizations in a window of {A} microbatches, expected "
                    "1: put every microbatch but the last inside model.no_sync(); DDP reads "
                    "the flag in the forward, so no_sync around the backward alone does nothing"
                )
            if syncs == 0:
                return (
                    "no gradient synchronization at all: the last microbatch must run outside "
                    "no_sync, so its backward all-reduces the accumulated gradient"
                )
            if syncs != 1:
                return f"{syncs} gradient synchronizations in window {w}, expected exactly 1"
    return None


def _diagnose_window(results: list[dict[str, Any]], references: list[Any]) -> str | None:
    """What is wrong with the answer's run (both ranks' results), or None."""
    problem = _diagnose_counts(results)
    if problem is not None:
        return problem
    seen = results[0]["seen"]  # one recorded gradient per window with targets
    for k, (w, ref) in enumerate((w, r) for w, r in enumerate(references) if r is not None):
        got = seen[k]
        if _close(ref["right"], got):
            continue
        previous = next((r for r in reversed(references[:w]) if r is not None), None)
        if previous is not None:
            carried = {k2: ref["right"][k2] + previous["right"][k2] for k2 in got}
            if _close(carried, got):
                return (
                    f"window {w}'s gradient still holds the previous window's: clear the "
                    "gradients (optimizer.zero_grad()) before the window's first backward"
                )
        if _close(ref["no × D"], got):
            return (
                "the gradient is 1/2 of the full batch's with 2 ranks: DDP averages over the "
                "D ranks, so multiply each loss_sum by D (dist.get_world_size()) / global count"
            )
        if "local count" in ref and _close(ref["local count"], got):
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
    for rank, result in enumerate(results):
        returned = result["returned"]
        for w, (got, ref) in enumerate(zip(returned, references, strict=True)):
            problem = _returned_problem(got, ref, w, rank)
            if problem is not None:
                return problem
        if any(result["grads_left"]):
            return "gradients are left after the update; clear them after optimizer.step()"
    return None


def _returned_problem(got: Any, ref: Any, w: int, rank: int) -> str | None:
    """What is wrong with the value rank ``rank`` returned for window ``w``, or None."""
    where = f"window {w}, rank {rank}"
    if ref is None:  # no targets anywhere: nothing to log
        if got is None or (isinstance(got, float) and math.isnan(got)):
            return None
        return (
            f"{where} has no targets on any rank and returned {got!r}: there is no mean loss "
            "to log; return float('nan')"
        )
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return (
            f"{where} returned {got!r}: return the window's mean loss per target over all "
            "ranks as a Python float (all-reduce the detached loss sums, divide by the "
            "global count, read once per window)"
        )
    expected = ref["loss"]
    if abs(got - expected) <= LOSS_RTOL * abs(expected):
        return None
    local = ref["local losses"][rank]
    if local is not None and abs(got - local) <= LOSS_RTOL * abs(local):
        return (
            f"{where} returned {got:.6g}, this rank's own mean; the window's loss is "
            f"{expected:.6g} over both ranks' targets: all-reduce the loss sums (every rank "
            "joins, also one without targets) and divide by the global count"
        )
    if abs(got - 2 * expected) <= LOSS_RTOL * 2 * abs(expected):
        return (
            f"{where} returned {got:.6g}, 2 × the window's loss {expected:.6g}: the × D "
            "belongs to the backpropagated value (DDP averages gradients), not to the log"
        )
    return f"{where} returned {got:.6g}, the window's mean loss over both ranks is {expected:.6g}"


#: Relative tolerance on the returned loss (float32 sums in another order).
LOSS_RTOL = 1e-5


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
        per_rank = launch(
            workers.run_window_answers, 2, (runnable, M, A, NO_TARGETS), timeout_s=20,
            deadline_s=180,
        )  # fmt: skip
    except Exception as exc:  # the learner's code failed on a rank: report it
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = (
            " (the ranks' collectives did not pair up: every rank must make the same calls "
            "in every window; a rank without targets still runs its forward and backward "
            "passes)"
        )
        return [f"your answer raised {type(exc).__name__}: {first[:300]}{hint}"] * len(answers)
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


def diagnose_uneven_windows(answers: Sequence[Callable[..., Any]]) -> list[str | None]:
    """Check several answers with one launch (what the tests use); None for a right one.
    An answer whose ranks make different collective calls breaks the whole launch: check
    such an answer on its own."""
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


def check_uneven_window(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` makes the full-batch update with one sync per window, returns
    the window's mean loss over all ranks and skips the window without targets on every
    rank, else why not. A stub raises
    ``NotImplementedError`` here, before any rank is launched."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    if _is_stub(answer):
        raise NotImplementedError
    verdict = diagnose_uneven_windows([answer])[0]
    if verdict is not None and verdict.startswith("your answer raised NotImplementedError"):
        raise NotImplementedError
    return verdict


uneven_window = Exercise(
    name="uneven_window",
    checker=check_uneven_window,
    hints=(
        "Count the window's targets on the CPU, put the number in a tensor and "
        "dist.all_reduce it: every rank then holds the same total, so every rank takes "
        "the same branch.",
        "A total of 0: return float('nan') at once, on every rank. Otherwise every rank runs every "
        "microbatch, also a rank whose own count is 0 (its loss_sum is 0, its backward adds "
        "nothing, but DDP's all-reduce needs it).",
        "Per microbatch: no_sync around the forward and backward of all but the last; "
        "backpropagate objective.loss_sum(model(input_ids=mb['input_ids']), mb) * "
        "dist.get_world_size() / total, and "
        "add loss_sum.detach() to a running tensor. Then optimizer.step(), "
        "optimizer.zero_grad().",
        "The log: dist.all_reduce the running sum (every rank calls it, also one without "
        "targets), then return float(running) / int(total).",
    ),
    reference=inspect.getsource(reference_uneven_window),
)


# ----------------------------------------------------------------------------- predict first

#: Notebook 04 §1: S = (40, 270), N = (10, 90); each rank divides by its own count and
#: DDP averages the two means.
LOCAL_COUNT_MEAN = (40 / 10 + 270 / 90) / 2

local_count_mean = number_prediction(
    __name__,
    "local_count_mean",
    LOCAL_COUNT_MEAN,
    what="DDP's mean of 40/10 and 270/90, the loss a per-rank count gives",
    mistakes={
        310 / 100: "the true window mean (310 / 100), which × D / global count gives; a "
        "per-rank count weights rank 0's 10 targets like rank 1's 90",
        310 / 100 / 2: "what / global count without × D gives",
    },
    hints=("Rank 0's mean is 40/10, rank 1's is 270/90; DDP averages what the ranks hold.",),
    reasoning="Each rank's own mean is 40 / 10 = 4.0 and 270 / 90 = 3.0, and DDP averages "
    "them: (4.0 + 3.0) / 2 = 3.5, while the window's token mean is 310 / 100 = 3.1, which "
    "only × D / global count gives. Rank 0's 10 targets weigh as much as rank 1's 90.",
)

#: Notebook 04 §2: syncs per window with no_sync around the forward only (A = 4).
SYNCS_FORWARD_ONLY = 1

syncs_forward_only = number_prediction(
    __name__,
    "syncs_forward_only",
    SYNCS_FORWARD_ONLY,
    what="gradient syncs per window of A = 4 with no_sync around the forwards only",
    mistakes={
        4: "what no no_sync at all gives; but DDP decides in the forward whether the next "
        "backward all-reduces, so a forward inside no_sync is enough",
        0: "the last microbatch runs outside no_sync, so it synchronizes once",
    },
    hints=("Which call reads model.no_sync()'s flag: the forward or the backward?",),
    reasoning="The forward decides. A forward run outside no_sync() prepares DDP's reducer "
    "to all-reduce the gradients during the backward that follows; a forward run inside it "
    "does not, and that backward only adds into the local .grad, wherever the backward "
    "itself runs. So only the last microbatch syncs, and its backward all-reduces the "
    "accumulated gradient: 1. Putting the backward inside too is the usual idiom, and what "
    "ddp_window does. Every placement gives the same gradient (synchronizing each microbatch "
    "averages partial sums, and the sum of averages is the average of sums): no_sync is "
    "about traffic, one synchronization per window instead of A. Each synchronization "
    "all-reduces every gradient bucket: one bucket for this small model, several for a "
    "larger one.",
)

__all__ = [
    "local_count_mean",
    "padding_plan",
    "reference_padding_plan",
    "reference_uneven_window",
    "syncs_forward_only",
    "uneven_window",
]
