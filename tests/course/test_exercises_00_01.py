"""Tests for the exercise checkers of notebooks 00 and 01: the reference passes, the
usual wrong answers fail with a message that names the mistake."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from accumlab import AccumulationPlan
from accumlab_course.exercises import ex00, ex01

torch.set_num_threads(1)

Window = Sequence[Mapping[str, Tensor]]


# --- ex00.accumulation_steps -----------------------------------------------------------


def test_reference_accumulation_steps_passes_and_matches_the_plan(capsys: Any) -> None:
    assert ex00.accumulation_steps.check(ex00.reference_accumulation_steps)
    assert "✓" in capsys.readouterr().out
    assert ex00.reference_accumulation_steps(32, 2, 2) == 8
    assert AccumulationPlan.from_effective_batch(32, 2, 2).accumulation_steps == 8
    with pytest.raises(ValueError):
        ex00.reference_accumulation_steps(30, 4, 2)


def _floor_division(effective: int, m: int, d: int = 1) -> int:
    return effective // (m * d)


def _ignores_replicas(effective: int, m: int, d: int = 1) -> int:
    return ex00.reference_accumulation_steps(effective, m, 1)


def _float_result(effective: int, m: int, d: int = 1) -> float:
    return float(ex00.reference_accumulation_steps(effective, m, d))


def _rejects_everything(effective: int, m: int, d: int = 1) -> int:
    raise ValueError("no")


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (_floor_division, "raise ValueError instead of rounding"),
        (_ignores_replicas, "expected"),
        (_float_result, "return an int"),
        (_rejects_everything, "raised ValueError, but"),
        ("not a function", "expected a function"),
    ],
)
def test_wrong_accumulation_steps_fail(answer: Any, reason: str, capsys: Any) -> None:
    assert ex00.check_accumulation_steps(answer) is not None
    assert reason in ex00.check_accumulation_steps(answer)
    assert not ex00.accumulation_steps.check(answer)
    assert "✗" in capsys.readouterr().out


def test_a_crashing_answer_is_reported_not_raised(capsys: Any) -> None:
    def crashes(effective: int, m: int, d: int = 1) -> int:
        raise ZeroDivisionError("oops")

    assert not ex00.accumulation_steps.check(crashes)
    assert "ZeroDivisionError" in capsys.readouterr().out


# --- ex00.replicas ----------------------------------------------------------------------


def test_reference_replicas_passes() -> None:
    assert ex00.check_replicas(ex00.reference_replicas) is None
    assert ex00.reference_replicas(8, 2, 2) == 2
    with pytest.raises(ValueError):
        ex00.reference_replicas(6, 4, 1)


def test_counting_gpus_as_replicas_fails() -> None:
    message = ex00.check_replicas(lambda gpus, t=1, p=1: gpus)
    assert message is not None and "a GPU is not a replica" in message


def test_rounding_replicas_fails() -> None:
    message = ex00.check_replicas(lambda gpus, t=1, p=1: gpus // (t * p))
    assert message is not None and "raise ValueError" in message


def test_hints_and_solution_print(capsys: Any) -> None:
    ex00.replicas.hint(2)
    ex01.accumulate_from_means.solution()
    ex01.adamw_ratio.solution()
    out = capsys.readouterr().out
    assert "hint 1/3" in out and "hint 2/3" in out and "hint 3/3" not in out
    assert "def reference_accumulate_from_means" in out and ".backward()" in out
    assert "answer: 1" in out


# --- ex01.accumulate_from_means ----------------------------------------------------------


def _kept(window: Window, count: Any) -> list[tuple[Mapping[str, Tensor], int]]:
    return [(mb, count(mb)) for mb in window if count(mb) > 0]


def means_no_division(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    for mb, n in _kept(window, count):
        (mean_loss(model, mb) * n).backward()


def average_of_means(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    for mb, _ in _kept(window, count):
        (mean_loss(model, mb) / len(window)).backward()


def sum_of_means(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    for mb, _ in _kept(window, count):
        mean_loss(model, mb).backward()


def mean_over_window_count(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    total = sum(count(mb) for mb in window)
    for mb, _ in _kept(window, count):
        (mean_loss(model, mb) / total).backward()  # forgets × count: a mean is not a sum


def empty_not_skipped(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    total = max(1, sum(count(mb) for mb in window))
    for mb in window:
        (mean_loss(model, mb) * count(mb) / total).backward()  # writes .grad for an empty window


def nan_gradient(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    ex01.reference_accumulate_from_means(model, window, mean_loss, count)
    next(model.parameters()).grad.view(-1)[0] = float("nan")


def zero_grad_inside(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    total = sum(count(mb) for mb in window)
    for mb, n in _kept(window, count):
        model.zero_grad(set_to_none=True)
        (mean_loss(model, mb) * n / total).backward()


def steps_inside(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    ex01.reference_accumulate_from_means(model, window, mean_loss, count)
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def does_nothing(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    return None


def half_the_gradient(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    total = sum(count(mb) for mb in window)
    for mb, n in _kept(window, count):
        (mean_loss(model, mb) * n / (2 * total)).backward()


def divides_by_a_zero_count(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    total = sum(count(mb) for mb in window)
    for mb in window:
        (mean_loss(model, mb) * (count(mb) / total)).backward()  # 0 / 0 for an empty window


def zeros_for_an_empty_window(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    ex01.reference_accumulate_from_means(model, window, mean_loss, count)
    if sum(count(mb) for mb in window) == 0:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)


def test_reference_accumulate_from_means_passes(capsys: Any) -> None:
    assert ex01.accumulate_from_means.check(ex01.reference_accumulate_from_means)
    assert "✓ accumulate_from_means" in capsys.readouterr().out


def test_checker_leaves_the_global_random_state_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ex01.check_accumulate_from_means(ex01.reference_accumulate_from_means)
    ex01.check_weighted_window_update(ex01.reference_weighted_window_update)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (means_no_division, "times the full-batch gradient"),
        (average_of_means, "average of the microbatch means"),
        (sum_of_means, "sum of the microbatch means"),
        (mean_over_window_count, "a mean is already divided by its own count"),
        (empty_not_skipped, "window without any target"),
        (nan_gradient, "holds NaN"),
        (zero_grad_inside, "only the last microbatch"),
        (steps_inside, "the weights changed"),
        (does_nothing, "no gradient at all"),
        (half_the_gradient, "differs from the full batch"),
        (zeros_for_an_empty_window, "window without any target"),
        (divides_by_a_zero_count, "raised ZeroDivisionError: count the window first"),
    ],
)
def test_wrong_windows_are_named_by_check(answer: Any, reason: str, capsys: Any) -> None:
    message = ex01.check_accumulate_from_means(answer)
    assert message is not None and reason in message
    assert not ex01.accumulate_from_means.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✗ accumulate_from_means:") and reason in out


def test_counting_examples_instead_of_targets_is_caught_on_the_gpt_case() -> None:
    """Weighting by rows is right for the MLP cases but not for the GPT's targets."""

    def by_rows(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
        total = sum(int(mb["labels"].shape[0]) for mb in window)
        for mb, _ in _kept(window, count):
            (mean_loss(model, mb) * int(mb["labels"].shape[0]) / total).backward()

    message = ex01.check_accumulate_from_means(by_rows)
    assert message is not None and "tiny GPT" in message


# --- ex01.weighted_window_update ---------------------------------------------------------


def weighted_update(
    *,
    denominator: str = "weight",
    clear_before: bool = True,
    clear_after: bool = True,
    step_each: bool = False,
    schedule: str = "once",
    skip_empty: bool = True,
    as_tensor: bool = False,
) -> Callable[..., Any]:
    """A weighted_window_update with one named mistake switched on."""

    def answer(model: nn.Module, window: Window, optimizer: Any, scheduler: Any) -> Any:
        weight = sum(float(mb["weight"].sum()) for mb in window)
        n = sum(int(mb["weight"].numel()) for mb in window)
        if skip_empty and weight == 0:
            return None
        if clear_before:
            optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        for mb in window:
            ce = nn.functional.cross_entropy(model(mb["x"]), mb["labels"], reduction="none")
            part = (mb["weight"] * ce).sum()
            total = {"weight": weight, "examples": n, "none": 1.0,
                     "own": float(mb["weight"].sum()) * len(window)}[denominator]
            (part / total).backward()
            loss_sum += part.detach()
            if step_each:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if schedule == "each":
                scheduler.step()
        if not step_each:
            optimizer.step()
        if clear_after:
            optimizer.zero_grad(set_to_none=True)
        if schedule == "once":
            scheduler.step()
        if as_tensor:
            return loss_sum / weight
        return float(loss_sum) / weight if weight else 0.0

    return answer


def unweighted(model: nn.Module, window: Window, optimizer: Any, scheduler: Any) -> float:
    optimizer.zero_grad(set_to_none=True)
    n = sum(int(mb["labels"].numel()) for mb in window)
    for mb in window:
        (nn.functional.cross_entropy(model(mb["x"]), mb["labels"], reduction="sum") / n).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return 0.0


def test_reference_weighted_window_update_passes(capsys: Any) -> None:
    assert ex01.weighted_window_update.check(ex01.reference_weighted_window_update)
    assert ex01.weighted_window_update.check(weighted_update())  # the same, written apart
    assert capsys.readouterr().out.count("✓ weighted_window_update: correct") == 2


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (weighted_update(denominator="examples"), "divided by the number of examples"),
        (weighted_update(denominator="none"), "was not divided by the window's total weight"),
        (weighted_update(denominator="own"), "average of the microbatches' weighted means"),
        (unweighted, "the weights were left out"),
        (weighted_update(clear_before=False), "clear .grad before the first microbatch"),
        (weighted_update(clear_after=False), "left in .grad after the update"),
        (weighted_update(step_each=True), "an update per microbatch"),
        (weighted_update(schedule="each"), "the scheduler advanced 3 times"),
        (weighted_update(schedule="never"), "the scheduler advanced 0 times"),
        (weighted_update(skip_empty=False), "weights are all 0"),
        (weighted_update(as_tensor=True), "as a float"),
    ],
)
def test_wrong_weighted_updates_are_named(answer: Any, reason: str, capsys: Any) -> None:
    message = ex01.check_weighted_window_update(answer)
    assert message is not None and reason in message, message
    assert not ex01.weighted_window_update.check(answer)
    assert capsys.readouterr().out.startswith("✗ weighted_window_update:")


def test_the_reference_update_equals_one_full_batch_step() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    twin = nn.Linear(6, 3)
    twin.load_state_dict(model.state_dict())
    window = ex01._weighted_window(5, [2, 3])
    loss = ex01.reference_weighted_window_update(model, window, torch.optim.SGD(model.parameters(), lr=1.0))
    x = torch.cat([mb["x"] for mb in window])
    y = torch.cat([mb["labels"] for mb in window])
    w = torch.cat([mb["weight"] for mb in window])
    full = (w * nn.functional.cross_entropy(twin(x), y, reduction="none")).sum() / w.sum()
    full.backward()
    torch.optim.SGD(twin.parameters(), lr=1.0).step()
    assert loss == pytest.approx(float(full.detach()), rel=1e-5)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert a.grad is None


# --- predictions (00 and 01) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("exercise", "right", "mistakes"),
    [
        (ex00.update_attempts, 3, {2: "short last window", 5: "microbatches", 2.5: "whole"}),
        (ex00.effective_batch, 64, {256: "only replicas count", 128: "same examples",
                                    32: "one replica"}),
        (ex01.undivided_gradient, 8, {2: "division by A", 0.5: "first microbatch"}),
        (ex01.adamw_ratio, 1.0, {3: "what SGD does", 1 / 3: "upside down"}),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_predictions_pass_right_name_mistakes_and_refuse_text(
    exercise: Any, right: float, mistakes: dict[float, str], capsys: Any
) -> None:
    assert exercise.check(right)
    for wrong, reason in mistakes.items():
        assert not exercise.check(wrong)
        assert reason in capsys.readouterr().out.splitlines()[-1]
    assert not exercise.check(right + 17)
    assert "run the next cell" in capsys.readouterr().out
    assert not exercise.check("eight")
    assert "as a number" in capsys.readouterr().out


def test_the_predicted_values_are_the_computed_ones() -> None:
    plan = AccumulationPlan(micro_batch_size=2, accumulation_steps=2)
    assert ex00.UPDATE_ATTEMPTS == sum(1 for _ in plan.windows(range(5))) == 3
    assert ex00.EFFECTIVE_BATCH == AccumulationPlan(4, 8, data_parallel_size=2).effective_batch_size
    w = torch.zeros((), requires_grad=True)
    for mean in (2.0, -1.0, 3.0, 4.0):
        (w * mean).backward()
    assert float(w.grad) == ex01.UNDIVIDED_GRADIENT == 8.0


# --- every exercise: wrong answers named through check(), stubs, the committed notebooks --


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (lambda gpus, t=1, p=1: gpus, "a GPU is not a replica"),
        (lambda gpus, t=1, p=1: gpus // (t * p), "raise ValueError"),
        (lambda gpus, t=1, p=1: ex00.reference_replicas(gpus, t, p) / 1, "return an int"),
        (lambda gpus, t=1, p=1: gpus // t, "expected"),  # pipeline stages forgotten
        (lambda gpus, t=1, p=1: ex00.reference_replicas(1, 2), "raised ValueError, but"),
        (8, "expected a function"),
    ],
)
def test_wrong_replicas_are_named_by_check(answer: Any, reason: str, capsys: Any) -> None:
    assert not ex00.replicas.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✗ replicas:") and reason in out


def test_reference_replicas_passes_through_check(capsys: Any) -> None:
    assert ex00.replicas.check(ex00.reference_replicas)
    assert capsys.readouterr().out == "✓ replicas: correct\n"


def zero_gradient(model: nn.Module, window: Window, mean_loss: Any, count: Any) -> None:
    for mb, _ in _kept(window, count):
        (0.0 * mean_loss(model, mb)).backward()


def test_a_zero_gradient_is_named(capsys: Any) -> None:
    assert not ex01.accumulate_from_means.check(zero_gradient)
    assert "the gradient is zero" in capsys.readouterr().out


def _raises_stub(*args: Any) -> Any:
    raise NotImplementedError("your code here")


EXERCISES_00_01 = [
    ex00.accumulation_steps, ex00.replicas, ex00.update_attempts, ex00.effective_batch,
    ex01.accumulate_from_means, ex01.weighted_window_update, ex01.undivided_gradient,
    ex01.adamw_ratio,
]
PREDICTIONS = {"update_attempts", "effective_batch", "undivided_gradient", "adamw_ratio"}


@pytest.mark.parametrize("exercise", EXERCISES_00_01, ids=lambda e: e.name)
def test_a_stub_is_not_attempted_yet(exercise: Any, capsys: Any) -> None:
    predicts = exercise.name in PREDICTIONS  # a value, `...` until the learner writes one
    stubs = (None, ...) if predicts else (_raises_stub, None, ...)
    for answer in stubs:
        assert exercise.check(answer) is False
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(stubs) and len(set(lines)) == 1  # one stable line
    assert lines[0].startswith(f"○ {exercise.name}: not attempted yet")
    assert f"{exercise.path}.hint()" in lines[0] and f"{exercise.path}.solution()" in lines[0]


@pytest.mark.parametrize(
    ("notebook", "exercises"),
    [
        ("00_start_here.ipynb", {"accumulation_steps": "ex00", "replicas": "ex00",
                                 "update_attempts": "ex00", "effective_batch": "ex00"}),
        ("01_single_device_loop.ipynb", {
            "accumulate_from_means": "ex01", "weighted_window_update": "ex01",
            "undivided_gradient": "ex01", "adamw_ratio": "ex01"}),
    ],
)
def test_the_committed_notebooks_ship_the_exercises_unsolved(
    notebook: str, exercises: dict[str, str]
) -> None:
    from helpers.notebook_exercises import assert_unsolved

    assert_unsolved(notebook, exercises)
