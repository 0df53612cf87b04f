"""Exercises for notebook 05 (memory instrumentation).

Two predict-first questions, answered with a number before the cell that measures it:

- ``momentum_baseline``: with SGD + momentum, the live bytes at the start of the *second*
  window, in units of the weights (a ``float``). The checker measures it on a tiny GPT.
- ``sum_then_backward_extra``: a loop that sums the window's losses and calls ``backward``
  once, at ``A = 8`` microbatches of 2: how many microbatches' saved activations above the
  same loop at ``A = 1`` does its peak hold (a ``float``)?

Two transfer exercises (the notebook shows the rule, not these cases):

- ``shrink_plan``: ``shrink_plan(m, A, D, largest) -> list[int]``. A run planned as
  ``m`` examples per microbatch, ``A`` microbatches per window and ``D`` replicas ran out
  of memory; at most ``largest`` examples fit in one microbatch. Return one replica's
  microbatch sizes for the same window after the shrink: every example kept (the sizes sum
  to ``m * A``), each at most ``largest``, as few microbatches as possible, and the largest
  as small as that count allows (it sets the peak). ``largest < 1`` raises ``ValueError`` (accumulation cannot split one
  example).
- ``plan_under_budget``: ``plan_under_budget(peaks, budget, effective_batch, replicas=1)
  -> tuple[int, int]``. ``peaks`` maps a few measured microbatch sizes to the peak bytes of
  a steady window (a fixed part plus a part proportional to ``m``); return ``(m, A)`` with
  ``m * A * replicas == effective_batch``, the predicted peak at ``m`` within ``budget``,
  and ``m`` as large as possible (``m`` need not be one of the measured sizes). Raise
  ``ValueError`` when no ``m`` fits, or when ``replicas`` does not divide the batch.

One exercise on the loss without the logits:

- ``chunked_loss_sum``: ``chunked_loss_sum(hidden, weight, targets, chunk) -> Tensor``, the
  summed cross-entropy of ``hidden @ weight.T`` (``hidden`` (N, H), ``weight`` (V, H))
  against ``targets`` (N,) with ``-100`` for no target, as a 0-d float32 tensor, computing
  at most ``chunk`` rows of logits at a time (forward only: the checker runs it under
  ``torch.no_grad``).

Each checker names the usual mistakes: examples dropped or divided among replicas, a
microbatch that still does not fit, halving more than needed, only the measured sizes
tried, an ``m`` that does not divide the window, the smallest ``m`` instead of the largest.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from accumlab.loop import train_window
from accumlab.memory import MemoryMeter
from accumlab.objectives import NextTokenLoss

from ..data import VOCAB_SIZE
from ..models import TinyGPT
from . import Exercise

# ---------------------------------------------------------------- predict first


def _number(answer: Any) -> float | str:
    """The prediction as a float, or the message for an answer that is not a number."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"expected a number (an int or a float), got {type(answer).__name__}"
    return float(answer)


def measured_momentum_baseline() -> float:
    """Live bytes at the start of the second window with SGD + momentum, in weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyGPT(VOCAB_SIZE, block_size=16, n_layer=1, n_head=2, n_embd=16)
        ids = torch.randint(2, VOCAB_SIZE, (4, 12))
    window = [{"input_ids": ids[:2], "labels": ids[:2]}, {"input_ids": ids[2:], "labels": ids[2:]}]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    meter = MemoryMeter("cpu")
    for _ in range(2):
        train_window(model, window, optimizer, NextTokenLoss(), meter=meter)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return meter.windows[1].baseline_bytes / weights


def check_momentum_baseline(answer: Any) -> str | None:
    """None when the prediction is the measured baseline (within 0.01), else why not."""
    value = _number(answer)
    if isinstance(value, str):
        return value
    expected = measured_momentum_baseline()
    if abs(value - expected) <= 0.01:
        return None
    known = (
        (expected + 1, "you counted the gradients too: the update clears them "
         "(zero_grad(set_to_none=True)), so none exist between windows"),
        (expected - 1, "weights only: momentum keeps one buffer per parameter, created at "
         "the first update and kept for the whole run"),
    )
    for wrong, message in known:
        if abs(value - wrong) <= 0.01:
            return f"{value:g} × weights: {message}"
    return (
        f"{value:g} × weights, measured {expected:.2f}: the baseline holds the weights and "
        "whatever the optimizer keeps between updates"
    )


def check_sum_then_backward_extra(answer: Any) -> str | None:
    """None when the prediction is A - 1 = 7 microbatches (within 0.5), else why not."""
    value = _number(answer)
    if isinstance(value, str):
        return value
    steps = 8
    if abs(value - (steps - 1)) <= 0.5:
        return None
    if abs(value - steps) <= 0.5:
        return (
            f"{value:g}: the loop at A = 1 already holds one microbatch's activations at its "
            f"peak; the extra is the other A - 1 = {steps - 1}"
        )
    if abs(value) <= 0.5:
        return (
            f"{value:g}: that is backward per microbatch; here every microbatch's graph, with "
            "its saved activations, waits for the one backward at the end of the window"
        )
    return f"{value:g}: every microbatch's saved activations stay alive until the one backward"


momentum_baseline = Exercise(
    name="momentum_baseline",
    checker=check_momentum_baseline,
    hints=(
        "List what is live between two windows: the weights, the gradients?, the optimizer's "
        "state?",
        "train_window ends with zero_grad(set_to_none=True); SGD with momentum keeps one "
        "buffer the size of each parameter.",
    ),
    reference=(
        "momentum_baseline = 2.0  # weights (1) + momentum buffers (1); gradients cleared\n"
        "Plain SGD keeps nothing between updates, momentum one buffer the size of the\n"
        "weights, AdamW two; the gradients are gone by then (zero_grad(set_to_none=True)\n"
        "closes every update). The state is made once, at the first update, and kept for\n"
        "the whole run."
    ),
    kind="prediction",
    answer=2.0,
)

sum_then_backward_extra = Exercise(
    name="sum_then_backward_extra",
    checker=check_sum_then_backward_extra,
    hints=(
        "Until the single backward, which microbatches' graphs (and saved activations) are "
        "alive?",
        "All A of them; the loop at A = 1 holds one at its peak as well.",
    ),
    reference=(
        "sum_then_backward_extra = 7  # A - 1 = 8 - 1 microbatches' activations\n"
        "Summing before backward keeps every microbatch's graph, with its saved activations,\n"
        "until the one backward: A - 1 more than the loop at A = 1. Backward per microbatch\n"
        "costs the same at any A beyond 1 (the gradients, which exist from the second\n"
        "microbatch on)."
    ),
    kind="prediction",
    answer=7,
)


# ---------------------------------------------------------------- the shrink, transferred


def reference_shrink_plan(m: int, A: int, D: int, largest: int) -> list[int]:
    """One replica's microbatch sizes for the same window after an out-of-memory error."""
    if largest < 1:
        raise ValueError("not even one example fits: use activation checkpointing")
    window = m * A  # this replica's examples per update; D replicas keep theirs
    count = math.ceil(window / largest)  # the fewest microbatches that each fit
    base, extra = divmod(window, count)  # sizes differ by at most one
    return [base + 1] * extra + [base] * (count - extra)


#: (m, A, D, largest) cases for the checker: uneven remainders, D > 1, and m * A < largest.
SHRINK_CASES = ((12, 2, 4, 5), (8, 4, 2, 3), (6, 3, 1, 4), (16, 1, 8, 7))


def _halvings(m: int, largest: int) -> int:
    while m > largest and m > 1:
        m //= 2
    return m


def _shrink_problem(sizes: Any, m: int, A: int, D: int, largest: int) -> str | None:
    where = f"m={m}, A={A}, D={D}, at most {largest} fit"
    if not isinstance(sizes, (list, tuple)) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in sizes
    ):
        return f"{where}: expected a list of ints (microbatch sizes), got {sizes!r}"
    window, needed = m * A, math.ceil(m * A / largest)
    if any(s < 1 for s in sizes):
        return f"{where}: {sizes} holds an empty microbatch; every microbatch needs an example"
    if sum(sizes) == window // D and D > 1:
        return (
            f"{where}: {sizes} holds {sum(sizes)} examples, m × A / D: the replicas do not "
            f"change, each keeps its own window of m × A = {window} examples"
        )
    if sum(sizes) < window:
        return (
            f"{where}: {sizes} drops {window - sum(sizes)} of the window's {window} examples; "
            f"keep every one (the effective batch m × A × D = {window * D} stays)"
        )
    if sum(sizes) > window:
        return f"{where}: {sizes} holds {sum(sizes)} examples, more than the window's {window}"
    if max(sizes) > largest:
        return f"{where}: a microbatch of {max(sizes)} examples still does not fit"
    if len(sizes) > needed:
        halved = _halvings(m, largest)
        if len(sizes) == math.ceil(window / halved) and halved < largest:
            return (
                f"{where}: {len(sizes)} microbatches of {halved}, halving until it fits; "
                f"{needed} microbatches of at most {largest} hold the same {window} examples"
            )
        return f"{where}: {len(sizes)} microbatches; {needed} of at most {largest} suffice"
    lowest = math.ceil(window / len(sizes))
    if max(sizes) > lowest:
        return (
            f"{where}: {sizes} has the fewest microbatches, but its largest ({max(sizes)}) sets "
            f"the peak: {len(sizes)} microbatches of at most {lowest} hold the same examples"
        )
    return None


def check_shrink_plan(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` plans every case right and rejects ``largest = 0``."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    for case in SHRINK_CASES:
        problem = _shrink_problem(answer(*case), *case)
        if problem is not None:
            return problem
    try:
        got = answer(4, 2, 2, 0)
    except ValueError:
        return None
    return (
        f"m=4, A=2, D=2, at most 0 fit: returned {got!r}; when not even one example fits, "
        "raise ValueError (accumulation never splits an example)"
    )


shrink_plan = Exercise(
    name="shrink_plan",
    checker=check_shrink_plan,
    hints=(
        "The window of one replica holds m × A examples before and after; D does not change.",
        "The fewest microbatches of at most `largest`: ceil(m × A / largest).",
        "divmod(m * A, count) gives a base size and how many microbatches get one more.",
    ),
    reference=inspect.getsource(reference_shrink_plan),
)


# ---------------------------------------------------------------- m and A under a budget


def reference_plan_under_budget(
    peaks: Mapping[int, int], budget: int, effective_batch: int, replicas: int = 1
) -> tuple[int, int]:
    """The largest ``m`` whose predicted peak fits ``budget``, and ``A`` for the batch."""
    if effective_batch % replicas:
        raise ValueError("replicas must divide the effective batch")
    window = effective_batch // replicas  # each replica's examples per update
    (m0, p0), (m1, p1) = min(peaks.items()), max(peaks.items())
    per_example = (p1 - p0) / (m1 - m0)  # the part that grows with m
    fixed = p0 - m0 * per_example  # weights, gradients, optimizer state
    for m in range(window, 0, -1):
        if window % m == 0 and fixed + m * per_example <= budget:
            return m, window // m
    raise ValueError("even m=1 does not fit: a smaller model or activation checkpointing")


#: (peaks, budget, effective batch, replicas, expected (m, A)): exact lines, so no rounding.
BUDGET_CASES: tuple[tuple[dict[int, int], int, int, int, tuple[int, int]], ...] = (
    ({1: 3_000, 2: 4_000, 4: 6_000}, 13_500, 64, 2, (8, 4)),  # 11 fit; 8 divides 32
    ({2: 10_000, 8: 22_000}, 30_000, 48, 1, (12, 4)),  # 12 fits exactly, never measured
    ({4: 50_000, 16: 98_000}, 500_000, 32, 4, (8, 1)),  # the whole window fits
    ({2: 40_000, 6: 60_000}, 70_000, 24, 1, (8, 3)),  # the fixed part is most of the peak
)


def _budget_problem(got: Any, case: tuple[Any, ...]) -> str | None:
    peaks, budget, batch, replicas, (m_ok, a_ok) = case
    (m0, p0), (m1, p1) = min(peaks.items()), max(peaks.items())
    slope = (p1 - p0) / (m1 - m0)

    def peak(m: int) -> float:
        return p0 + (m - m0) * slope

    where = f"peaks {peaks}, budget {budget}, effective batch {batch} on {replicas} replica(s)"
    if (
        not isinstance(got, tuple)
        or len(got) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in got)
    ):
        return f"{where}: expected a tuple (m, A) of two ints, got {got!r}"
    m, a = got
    if (m, a) == (m_ok, a_ok):
        return None
    if m < 1 or a < 1:
        return f"{where}: ({m}, {a}) needs m >= 1 and A >= 1"
    if m * a == batch and replicas > 1:
        return (
            f"{where}: ({m}, {a}) gives m × A = {batch} per replica, {batch * replicas} in all; "
            f"each replica's window is the batch / D = {batch // replicas}"
        )
    if m * a * replicas != batch:
        return f"{where}: ({m}, {a}) gives m × A × D = {m * a * replicas}, not {batch}"
    if peak(m) > budget:
        return f"{where}: m={m} is predicted to peak at {peak(m):.0f} bytes, over the budget"
    window = batch // replicas
    measured = [k for k in peaks if window % k == 0 and peak(k) <= budget]
    if measured and m == max(measured) and m_ok not in peaks:
        return (
            f"{where}: m={m} is the largest measured size that fits, but the peak is a line in "
            f"m (fixed part + m × per example): m={m_ok} fits too and is never measured"
        )
    return (
        f"{where}: m={m} fits, but m={m_ok} (A={a_ok}) fits as well: the largest m that fits "
        "and divides the window needs the fewest microbatches, and small ones are slower"
    )


def check_plan_under_budget(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` picks the expected plan in every case and raises ValueError when
    nothing fits or the replicas do not divide the batch."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    for case in BUDGET_CASES:
        problem = _budget_problem(answer(copy.deepcopy(case[0]), *case[1:4]), case)
        if problem is not None:
            return problem
    peaks = {1: 3_000, 4: 6_000}
    for budget, batch, replicas, why in (
        (2_500, 16, 1, "even m=1 is predicted to peak at 3000 bytes"),
        (100_000, 30, 4, "4 replicas cannot share 30 examples equally"),
    ):
        try:
            got = answer(dict(peaks), budget, batch, replicas)
        except ValueError:
            continue
        return (
            f"peaks {peaks}, budget {budget}, effective batch {batch} on {replicas} replica(s): "
            f"returned {got!r}, but {why}; raise ValueError"
        )
    return None


plan_under_budget = Exercise(
    name="plan_under_budget",
    checker=check_plan_under_budget,
    hints=(
        "Two measured points give the line: per example = (p1 - p0) / (m1 - m0), fixed part "
        "= p0 - m0 × per example.",
        "Each replica's window holds effective_batch / replicas examples; m must divide it.",
        "Try m from the whole window down to 1; the first that divides and fits is the plan.",
    ),
    reference=inspect.getsource(reference_plan_under_budget),
)



# ---------------------------------------------------------------- the loss without the logits


def reference_chunked_loss_sum(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets``, ``chunk`` rows at a
    time: never more than ``chunk × V`` logits exist."""
    total = torch.zeros((), dtype=torch.float32)
    for start in range(0, len(targets), chunk):
        logits = hidden[start : start + chunk] @ weight.T  # (at most chunk, V)
        total += F.cross_entropy(
            logits.float(), targets[start : start + chunk], ignore_index=-100, reduction="sum"
        )
    return total


class _LargestOutput(TorchDispatchMode):
    """Records the most elements of any tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.most = max(self.most, t.numel())
        return out


#: (positions N, hidden H, vocabulary V, chunk, seed): a last chunk shorter than the others,
#: a chunk without any target, and a chunk larger than N.
CHUNK_CASES = ((23, 8, 50, 5, 1), (16, 4, 40, 4, 2), (6, 8, 30, 10, 3))


def _chunk_case(n: int, h: int, v: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::3] = -100  # positions without a target (prompt, padding)
    if n >= 8:
        targets[4:8] = -100  # one chunk of 4 holds no target at all
    return hidden, weight, targets


def check_chunked_loss_sum(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` returns the summed loss (relative error <= 1e-5) without any
    tensor of more than ``chunk × V`` elements, in every case."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    for n, h, v, chunk, seed in CHUNK_CASES:
        hidden, weight, targets = _chunk_case(n, h, v, seed)
        full = hidden @ weight.T
        expected = F.cross_entropy(full, targets, ignore_index=-100, reduction="sum")
        where = f"N={n} positions, V={v}, chunk={chunk}"
        largest = _LargestOutput()
        with torch.no_grad(), largest:
            got = answer(hidden, weight, targets, chunk)
        if not isinstance(got, Tensor) or got.dim() != 0:
            return f"{where}: expected a 0-d tensor (the summed loss), got {got!r}"
        if largest.most > max(min(chunk, n) * v, v * h):  # a view of the weight is allowed
            return (
                f"{where}: a tensor of {largest.most} numbers existed, more than one chunk of "
                f"logits (chunk × V = {min(chunk, n) * v}): compute the logits of one chunk of "
                "rows at a time, never the full logits"
            )
        value, exact = float(got), float(expected)
        if abs(value - exact) <= 1e-5 * abs(exact):
            continue
        counted = int((targets != -100).sum())
        kept = (n // chunk) * chunk
        dropped = F.cross_entropy(full[:kept], targets[:kept], ignore_index=-100, reduction="sum")
        if abs(value - exact / counted) <= 1e-5 * abs(exact / counted):
            return (
                f"{where}: returned the mean per target; return the sum (the loop divides by "
                "the window's count)"
            )
        if kept < n and abs(value - float(dropped)) <= 1e-5 * abs(float(dropped)):
            return f"{where}: the last chunk of {n - kept} positions is missing"
        means = sum(
            float(F.cross_entropy(full[i : i + chunk], targets[i : i + chunk], ignore_index=-100))
            for i in range(0, n, chunk)
        )
        if abs(value - means) <= 1e-5 * abs(means):
            return (
                f"{where}: the sum of each chunk's mean; chunks hold different numbers of "
                "targets, so add each chunk's sum (reduction='sum')"
            )
        if value != value:  # nan
            return (
                f"{where}: nan: a chunk without any target has a mean of 0/0; sum each chunk's "
                "losses (reduction='sum') instead of averaging"
            )
        return f"{where}: returned {value:.6g}, expected the summed loss {exact:.6g}"
    return None


chunked_loss_sum = Exercise(
    name="chunked_loss_sum",
    checker=check_chunked_loss_sum,
    hints=(
        "Loop over start in range(0, len(targets), chunk); the slice hidden[start:start+chunk] "
        "may be shorter at the end.",
        "logits = rows @ weight.T is (rows, V); F.cross_entropy(logits, targets_of_rows, "
        "ignore_index=-100, reduction='sum') skips the positions without a target.",
        "Add each chunk's sum into a 0-d tensor and return it.",
    ),
    reference=inspect.getsource(reference_chunked_loss_sum),
)
