"""Exercises for notebook 00 (start here): sizes of one update.

- ``accumulation_steps``: write ``accumulation_steps(effective_batch_size,
  micro_batch_size, data_parallel_size=1) -> int``, the ``A`` with ``m × A × D`` equal to
  the effective batch, raising ``ValueError`` when it does not divide. Checked against
  ``AccumulationPlan.from_effective_batch`` on many cases.
- ``replicas``: write ``replicas(gpus, tensor_parallel_size=1, pipeline_parallel_size=1)
  -> int``, the number of data-parallel replicas ``D`` in a job, raising ``ValueError``
  when the GPUs do not split into whole model copies.

Predict first (a number written before the cell that computes it): ``update_attempts``
(10 examples, ``m = 2``, ``A = 2``) and ``effective_batch`` (8 GPUs as ``T = 2 × P = 2``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from accumlab.plan import AccumulationPlan

from ..widgets import effective_batch_table
from . import Exercise
from .predictions import number_prediction

# --- accumulation_steps ----------------------------------------------------------------


def reference_accumulation_steps(
    effective_batch_size: int, micro_batch_size: int, data_parallel_size: int = 1
) -> int:
    """A = effective / (m × D); ValueError when m × D does not divide the effective
    batch."""
    per_window = micro_batch_size * data_parallel_size
    steps, remainder = divmod(effective_batch_size, per_window)
    if remainder or steps == 0:
        raise ValueError(
            f"{effective_batch_size} examples per update is not a multiple of "
            f"m × D = {per_window}"
        )
    return steps


def _steps_cases() -> list[tuple[int, int, int]]:
    """(effective, m, D) triples; the divisible ones first, so a wrong formula is reported
    on a case with an answer before a missing ValueError is."""
    cases = [
        (effective, m, d)
        for effective in (1, 2, 3, 8, 12, 30, 32, 48, 64, 96, 100, 128, 255, 256, 1000, 1024)
        for m in (1, 2, 3, 4, 5, 8, 16, 64)
        for d in (1, 2, 3, 4, 8)
    ]
    return sorted(cases, key=lambda c: c[0] % (c[1] * c[2]) != 0 or c[0] < c[1] * c[2])


def check_accumulation_steps(answer: Callable[..., int]) -> str | None:
    """None when ``answer`` agrees with ``AccumulationPlan.from_effective_batch`` on every
    case (same A, or a ValueError where the plan refuses), else what went wrong."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    for effective, m, d in _steps_cases():
        call = f"accumulation_steps({effective}, {m}, {d})"
        try:
            expected: int | None = AccumulationPlan.from_effective_batch(
                effective, m, d
            ).accumulation_steps
        except ValueError:
            expected = None
        try:
            got = answer(effective, m, d)
        except ValueError:
            if expected is None:
                continue
            return f"{call} raised ValueError, but {m} × {expected} × {d} = {effective} works"
        if expected is None:
            return (
                f"{call} returned {got!r}, but {m} × {d} = {m * d} does not divide {effective}: "
                "raise ValueError instead of rounding"
            )
        if isinstance(got, bool) or not isinstance(got, int):
            return f"{call} returned {got!r} ({type(got).__name__}); return an int (use //)"
        if got != expected:
            return f"{call} returned {got}, expected {expected}"
    return None


accumulation_steps = Exercise(
    name="accumulation_steps",
    checker=check_accumulation_steps,
    hints=(
        "One window on one replica holds m examples per microbatch × A microbatches; D "
        "replicas each run a window, so an update sees m × A × D examples.",
        "divmod(effective_batch_size, micro_batch_size * data_parallel_size) gives A and "
        "the remainder in one call.",
        "A nonzero remainder means some update would see a different number of examples: "
        "raise ValueError. So does A == 0 (the effective batch is smaller than m × D).",
    ),
    reference=inspect.getsource(reference_accumulation_steps),
)


# --- replicas ---------------------------------------------------------------------------


def reference_replicas(
    gpus: int, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
) -> int:
    """D = GPUs / (T × P): GPUs that share one model copy are one replica."""
    per_replica = tensor_parallel_size * pipeline_parallel_size
    d, remainder = divmod(gpus, per_replica)
    if remainder or d == 0:
        raise ValueError(
            f"{gpus} GPUs do not split into model copies of T × P = {per_replica}"
        )
    return d


def check_replicas(answer: Callable[..., int]) -> str | None:
    """None when ``answer`` returns GPUs / (T × P) on every divisible case and raises
    ValueError on every other one, else what went wrong."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    cases = [
        (gpus, t, p)
        for gpus in (1, 2, 3, 4, 6, 8, 12, 16, 24, 64, 96)
        for t in (1, 2, 4, 8)
        for p in (1, 2, 3, 4)
    ]
    for gpus, t, p in sorted(cases, key=lambda c: c[0] % (c[1] * c[2]) != 0):
        call = f"replicas({gpus}, {t}, {p})"
        divisible = gpus % (t * p) == 0
        try:
            got = answer(gpus, t, p)
        except ValueError:
            if not divisible:
                continue
            return f"{call} raised ValueError, but {gpus} GPUs hold {gpus // (t * p)} copies"
        if not divisible:
            return (
                f"{call} returned {got!r}, but {gpus} GPU(s) cannot be split into model "
                f"copies of {t} × {p} = {t * p} GPUs: raise ValueError"
            )
        if isinstance(got, bool) or not isinstance(got, int):
            return f"{call} returned {got!r} ({type(got).__name__}); return an int"
        if got != gpus // (t * p):
            hint = " (a GPU is not a replica)" if got == gpus else ""
            return f"{call} returned {got}, expected {gpus // (t * p)}{hint}"
    return None


replicas = Exercise(
    name="replicas",
    checker=check_replicas,
    hints=(
        "A replica is one whole copy of the model that sees its own examples.",
        "Tensor parallelism splits each layer over T GPUs and pipeline parallelism splits "
        "the layers over P stages, so one copy occupies T × P GPUs.",
        "D = gpus // (T × P); raise ValueError when the division leaves a remainder.",
    ),
    reference=inspect.getsource(reference_replicas),
)


# --- predict first ----------------------------------------------------------------------

#: 10 examples in microbatches of m = 2 (5 microbatches), windows of A = 2, the short last
#: window updated (``last_window="update"``): one update attempt per window.
UPDATE_ATTEMPTS = len(list(AccumulationPlan(2, 2).windows(range(5))))

update_attempts = number_prediction(
    __name__,
    "update_attempts",
    UPDATE_ATTEMPTS,
    what="update attempts from 10 examples with m = 2, A = 2",
    mistakes={
        2: "the complete windows only: the short last window (one microbatch) makes an "
        "update attempt too when last_window='update'",
        2.5: "10 / (m × A): windows are whole, and a short last one still counts",
        5: "the microbatches (one backward pass each): an update comes once per window",
        10: "the examples",
    },
    hints=(
        "10 examples in microbatches of 2 make 5 microbatches; a window holds A = 2 of them.",
        "The plan never drops a microbatch: what is left after the full windows is a short "
        "window, and with last_window='update' it is updated from too.",
    ),
    reasoning="5 microbatches in windows of 2: two full windows and a short one of 1 "
    "microbatch; one update attempt per window.",
)

#: The widget's starting job: 8 GPUs as 2 replicas of T = 2 × P = 2, m = 4, A = 8.
EFFECTIVE_BATCH = effective_batch_table(
    4, 8, data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2
)["effective_batch_size"]

effective_batch = number_prediction(
    __name__,
    "effective_batch",
    EFFECTIVE_BATCH,
    what="examples per update for m = 4, A = 8 on 8 GPUs as T = 2 × P = 2",
    mistakes={
        256: "m × A × GPUs: tensor- and pipeline-parallel GPUs share one model copy and "
        "its examples, only replicas count",
        128: "m × A × (T × P): the GPUs of one replica see the same examples",
        32: "one replica's window (m × A); there are D = 8 / (2 × 2) = 2 replicas",
    },
    hints=(
        "Only data-parallel replicas multiply the batch: D = GPUs / (T × P).",
        "Effective batch = m × A × D.",
    ),
    reasoning="D = 8 / (2 × 2) = 2 replicas, so m × A × D = 4 × 8 × 2.",
)
