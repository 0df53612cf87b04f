"""Exercises of notebook 05: every checker passes its reference, names each usual wrong
answer, reads a stub as not attempted; the committed notebook ships them unsolved."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from accumlab_course.exercises import NOT_ATTEMPTED, ex05

torch.set_num_threads(1)

EXERCISES = (
    ex05.momentum_baseline,
    ex05.sum_then_backward_extra,
    ex05.shrink_plan,
    ex05.plan_under_budget,
    ex05.chunked_loss_sum,
)
FUNCTIONS = {"shrink_plan", "plan_under_budget", "chunked_loss_sum"}


def test_the_references_pass(capsys: Any) -> None:
    assert ex05.momentum_baseline.check(2.0) and ex05.momentum_baseline.check(2)
    assert ex05.sum_then_backward_extra.check(7) and ex05.sum_then_backward_extra.check(6.95)
    assert ex05.shrink_plan.check(ex05.reference_shrink_plan)
    assert ex05.plan_under_budget.check(ex05.reference_plan_under_budget)
    assert ex05.chunked_loss_sum.check(ex05.reference_chunked_loss_sum)
    out = capsys.readouterr().out
    for exercise in EXERCISES:
        assert f"✓ {exercise.name}: correct" in out


def test_the_momentum_baseline_is_measured() -> None:
    assert ex05.measured_momentum_baseline() == pytest.approx(2.0, abs=1e-9)


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (3.0, "you counted the gradients too"),
        (1, "weights only"),
        (4.5, "whatever the optimizer keeps"),
        ("2", "expected a number"),
        (True, "expected a number"),
    ],
)
def test_momentum_baseline_names_each_mistake(answer: Any, named: str, capsys: Any) -> None:
    assert not ex05.momentum_baseline.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✗ momentum_baseline:") and named in out, out


@pytest.mark.parametrize(
    ("answer", "named"),
    [(8, "already holds one microbatch"), (0, "that is backward per microbatch"),
     (3, "stay alive until the one backward"), ([7], "expected a number")],
)
def test_sum_then_backward_extra_names_each_mistake(answer: Any, named: str, capsys: Any) -> None:
    assert not ex05.sum_then_backward_extra.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✗ sum_then_backward_extra:") and named in out, out


# ---------------------------------------------------------------- shrink_plan


def _split(m: int, A: int, largest: int) -> list[int]:
    """Halve m until it fits (what on_oom='shrink' does), and cut the window into that size."""
    size = m
    while size > largest:
        size //= 2
    window = m * A
    return [size] * (window // size) + ([window % size] if window % size else [])


def halve_until_it_fits(m: int, A: int, D: int, largest: int) -> list[int]:
    if largest < 1:
        raise ValueError
    return _split(m, A, largest)


def drops_the_remainder(m: int, A: int, D: int, largest: int) -> list[int]:
    if largest < 1:
        raise ValueError
    return [largest] * (m * A // largest)


def divides_among_replicas(m: int, A: int, D: int, largest: int) -> list[int]:
    if largest < 1:
        raise ValueError
    return ex05.reference_shrink_plan(m, A, 1, largest) if D == 1 else ex05.reference_shrink_plan(
        m * A // D, 1, 1, largest)


def greedy(m: int, A: int, D: int, largest: int) -> list[int]:
    if largest < 1:
        raise ValueError
    window = m * A
    return [largest] * (window // largest) + ([window % largest] if window % largest else [])


def keeps_m(m: int, A: int, D: int, largest: int) -> list[int]:
    if largest < 1:
        raise ValueError
    return [m] * A


def never_raises(m: int, A: int, D: int, largest: int) -> list[int]:
    return ex05.reference_shrink_plan(m, A, D, max(largest, 1))


def one_per_microbatch(m: int, A: int, D: int, largest: int) -> list[int]:
    if largest < 1:
        raise ValueError
    return [1] * (m * A)


def as_a_count(m: int, A: int, D: int, largest: int) -> int:
    return math.ceil(m * A / largest)


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (halve_until_it_fits, "halving until it fits"),
        (drops_the_remainder, "drops"),
        (divides_among_replicas, "the replicas do not change"),
        (greedy, "sets the peak"),
        (keeps_m, "still does not fit"),
        (never_raises, "raise ValueError"),
        (one_per_microbatch, "suffice"),
        (as_a_count, "expected a list of ints"),
        ("not a function", "expected a function"),
    ],
)
def test_shrink_plan_names_each_mistake(answer: Any, named: str, capsys: Any) -> None:
    assert not ex05.shrink_plan.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✗ shrink_plan:") and named in out, out


def test_shrink_plan_reference_keeps_every_example() -> None:
    for m, A, D, largest in ex05.SHRINK_CASES:
        sizes = ex05.reference_shrink_plan(m, A, D, largest)
        assert sum(sizes) == m * A and max(sizes) <= largest
        assert len(sizes) == math.ceil(m * A / largest) and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="checkpointing"):
        ex05.reference_shrink_plan(4, 2, 1, 0)


# ---------------------------------------------------------------- plan_under_budget


def _line(peaks: dict[int, int]) -> tuple[float, float]:
    (m0, p0), (m1, p1) = min(peaks.items()), max(peaks.items())
    slope = (p1 - p0) / (m1 - m0)
    return p0 - m0 * slope, slope


def only_measured(peaks, budget, batch, replicas=1):
    window = batch // replicas
    fixed, slope = _line(peaks)
    for m in sorted(peaks, reverse=True):
        if window % m == 0 and fixed + m * slope <= budget:
            return m, window // m
    return ex05.reference_plan_under_budget(peaks, budget, batch, replicas)


def largest_that_fits(peaks, budget, batch, replicas=1):
    window = batch // replicas
    fixed, slope = _line(peaks)
    m = min(window, int((budget - fixed) // slope))
    return m, window // m


def smallest(peaks, budget, batch, replicas=1):
    m, a = ex05.reference_plan_under_budget(peaks, budget, batch, replicas)
    return 1, m * a


def forgets_replicas(peaks, budget, batch, replicas=1):
    return ex05.reference_plan_under_budget(peaks, budget, batch, 1)


def ignores_the_fixed_part(peaks, budget, batch, replicas=1):
    window = batch // replicas
    _, slope = _line(peaks)
    for m in range(window, 0, -1):
        if window % m == 0 and m * slope <= budget:
            return m, window // m
    raise ValueError


def never_raises_either(peaks, budget, batch, replicas=1):
    try:
        return ex05.reference_plan_under_budget(peaks, budget, batch, replicas)
    except ValueError:
        return 1, batch


def as_a_list(peaks, budget, batch, replicas=1):
    return list(ex05.reference_plan_under_budget(peaks, budget, batch, replicas))


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (only_measured, "never measured"),
        (largest_that_fits, "not 64"),
        (smallest, "fits as well"),
        (forgets_replicas, "each replica's window is the batch / D"),
        (ignores_the_fixed_part, "over the budget"),
        (never_raises_either, "raise ValueError"),
        (as_a_list, "expected a tuple (m, A)"),
        ("not a function", "expected a function"),
    ],
)
def test_plan_under_budget_names_each_mistake(answer: Any, named: str, capsys: Any) -> None:
    assert not ex05.plan_under_budget.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✗ plan_under_budget:") and named in out, out


def test_the_budget_cases_agree_with_the_reference() -> None:
    for peaks, budget, batch, replicas, expected in ex05.BUDGET_CASES:
        assert ex05.reference_plan_under_budget(peaks, budget, batch, replicas) == expected


# ---------------------------------------------------------------- chunked_loss_sum


def full_logits(hidden, weight, targets, chunk):
    return F.cross_entropy(hidden @ weight.T, targets, reduction="sum")


def mean_per_target(hidden, weight, targets, chunk):
    return ex05.reference_chunked_loss_sum(hidden, weight, targets, chunk) / (targets != -100).sum()


def drops_the_last_chunk(hidden, weight, targets, chunk):
    total = torch.zeros(())
    for start in range(0, len(targets) - chunk + 1, chunk):
        rows = slice(start, start + chunk)
        total += F.cross_entropy(hidden[rows] @ weight.T, targets[rows], reduction="sum")
    return total


def sums_chunk_means(hidden, weight, targets, chunk):
    total = torch.zeros(())
    for start in range(0, len(targets), chunk):
        rows = slice(start, start + chunk)
        total += F.cross_entropy(hidden[rows] @ weight.T, targets[rows])
    return total


def as_a_float(hidden, weight, targets, chunk):
    return float(ex05.reference_chunked_loss_sum(hidden, weight, targets, chunk))


def counts_ignored_positions(hidden, weight, targets, chunk):
    return ex05.reference_chunked_loss_sum(hidden, weight, targets.clamp(min=0), chunk)


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (full_logits, "never the full logits"),
        (mean_per_target, "returned the mean per target"),
        (drops_the_last_chunk, "the last chunk of 3 positions is missing"),
        (sums_chunk_means, "the sum of each chunk's mean"),
        (as_a_float, "expected a 0-d tensor"),
        (counts_ignored_positions, "expected the summed loss"),
        ("not a function", "expected a function"),
    ],
)
def test_chunked_loss_sum_names_each_mistake(answer: Any, named: str, capsys: Any) -> None:
    assert not ex05.chunked_loss_sum.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✗ chunked_loss_sum:") and named in out, out


def test_chunked_loss_sum_reference_equals_the_package_loss() -> None:
    # The exercise's forward is ChunkedNextTokenLoss's: same sum on shifted hidden states.
    import accumlab as al

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden = torch.randn(2, 7, 8, generator=g)
    labels = torch.randint(0, 30, (2, 7), generator=g)
    labels[:, :2] = -100
    expected = al.ChunkedNextTokenLoss(head, chunk_size=3).loss_sum(hidden, {"labels": labels})
    with torch.no_grad():
        got = ex05.reference_chunked_loss_sum(
            hidden[:, :-1].reshape(-1, 8), head.weight, labels[:, 1:].reshape(-1), 3
        )
    torch.testing.assert_close(got, expected.detach())


# ---------------------------------------------------------------- stubs and the notebook


def test_stubs_print_the_not_attempted_line(capsys: Any) -> None:
    def stub(*args: Any) -> Any:
        raise NotImplementedError

    for exercise in EXERCISES:
        assert exercise.check(stub if exercise.name in FUNCTIONS else ...) is False
        out = capsys.readouterr().out
        assert out.startswith(f"○ {exercise.name}: {NOT_ATTEMPTED}.") and ".solution()" in out


def test_hints_and_solutions_print(capsys: Any) -> None:
    for exercise in EXERCISES:
        exercise.hint(len(exercise.hints))
        exercise.solution()
    out = capsys.readouterr().out
    assert "def reference_shrink_plan" in out and "def reference_plan_under_budget" in out
    assert "def reference_chunked_loss_sum" in out
    assert "momentum_baseline = 2.0" in out and "sum_then_backward_extra = 7" in out


def test_the_checkers_leave_the_random_state_alone() -> None:
    state = torch.get_rng_state()
    ex05.momentum_baseline.check(2.0)
    assert torch.equal(torch.get_rng_state(), state)


def test_committed_notebook_ships_every_exercise_unsolved() -> None:
    from helpers.notebook_exercises import assert_unsolved

    assert_unsolved(
        "05_memory_instrumentation.ipynb",
        {e.name: "ex05" for e in EXERCISES},
    )
