"""Tests for the exercise checkers of notebooks 00 and 01: the reference passes, the
usual wrong answers fail with a message that names the mistake."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from accumlab import AccumulationPlan
from accumlab.course.exercises import ex00, ex01

torch.set_num_threads(1)

Window = Sequence[Mapping[str, Tensor]]
Forward = Callable[[nn.Module, Mapping[str, Tensor]], Any]


# --- ex00.accumulation_steps -----------------------------------------------------------


def test_reference_accumulation_steps_passes_and_matches_the_plan(capsys: Any) -> None:
    assert ex00.accumulation_steps.check(ex00.reference_accumulation_steps)
    assert "✅" in capsys.readouterr().out
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
    assert "❌" in capsys.readouterr().out


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
    ex01.accumulate_window.solution()
    out = capsys.readouterr().out
    assert "hint 1/3" in out and "hint 2/3" in out and "hint 3/3" not in out
    assert "def reference_accumulate_window" in out and ".backward()" in out


# --- ex01.accumulate_window -------------------------------------------------------------


def _loss(model: nn.Module, mb: Mapping[str, Tensor], objective: Any, forward: Forward) -> Tensor:
    return objective.loss_sum(forward(model, mb), mb)


def no_division(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
    for mb in window:
        _loss(model, mb, objective, forward).backward()


def average_of_means(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
    for mb in window:
        (_loss(model, mb, objective, forward) / objective.count(mb) / len(window)).backward()


def sum_of_means(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
    for mb in window:
        (_loss(model, mb, objective, forward) / objective.count(mb)).backward()


def zero_grad_inside(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
    total = sum(objective.count(mb) for mb in window)
    for mb in window:
        model.zero_grad(set_to_none=True)
        (_loss(model, mb, objective, forward) / total).backward()


def steps_inside(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
    ex01.reference_accumulate_window(model, window, objective, forward)
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def does_nothing(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
    return None


def half_the_gradient(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
    total = sum(objective.count(mb) for mb in window)
    for mb in window:
        (_loss(model, mb, objective, forward) / (2 * total)).backward()


def test_reference_accumulate_window_passes(capsys: Any) -> None:
    assert ex01.accumulate_window.check(ex01.reference_accumulate_window)
    assert "✅ accumulate_window" in capsys.readouterr().out


def test_checker_leaves_the_global_random_state_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ex01.check_accumulate_window(ex01.reference_accumulate_window)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (no_division, "times the full-batch gradient"),
        (average_of_means, "average of the microbatch means"),
        (sum_of_means, "sum of the microbatch means"),
        (zero_grad_inside, "only the last microbatch"),
        (steps_inside, "the weights changed"),
        (does_nothing, "no gradient at all"),
        (half_the_gradient, "differs from the full batch"),
    ],
)
def test_wrong_windows_fail_with_the_named_mistake(answer: Any, reason: str) -> None:
    message = ex01.check_accumulate_window(answer)
    assert message is not None
    assert reason in message


def test_token_counting_mistake_is_caught_on_the_gpt_case() -> None:
    """Dividing by examples instead of targets is right for the MLP cases but not the GPT."""

    def by_examples(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
        total = sum(int(mb["labels"].shape[0]) for mb in window)
        for mb in window:
            (_loss(model, mb, objective, forward) / total).backward()

    message = ex01.check_accumulate_window(by_examples)
    assert message is not None and "tiny GPT" in message


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
    assert out.startswith("❌ replicas:") and reason in out


def test_reference_replicas_passes_through_check(capsys: Any) -> None:
    assert ex00.replicas.check(ex00.reference_replicas)
    assert capsys.readouterr().out == "✅ replicas: correct\n"


def zero_gradient(model: nn.Module, window: Window, objective: Any, forward: Forward) -> None:
    for mb in window:
        (0.0 * _loss(model, mb, objective, forward)).backward()


def test_a_zero_gradient_is_named(capsys: Any) -> None:
    assert not ex01.accumulate_window.check(zero_gradient)
    assert "the gradient is zero" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (no_division, "times the full-batch gradient"),
        (average_of_means, "average of the microbatch means"),
        (zero_grad_inside, "only the last microbatch"),
        (steps_inside, "the weights changed"),
    ],
)
def test_wrong_windows_are_named_by_check(answer: Any, reason: str, capsys: Any) -> None:
    assert not ex01.accumulate_window.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("❌ accumulate_window:") and reason in out


def _raises_stub(*args: Any) -> Any:
    raise NotImplementedError("your code here")


@pytest.mark.parametrize(
    "exercise", [ex00.accumulation_steps, ex00.replicas, ex01.accumulate_window], ids=str
)
def test_a_stub_is_not_attempted_yet(exercise: Any, capsys: Any) -> None:
    for answer in (_raises_stub, None, ...):
        assert exercise.check(answer) is False
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and len(set(lines)) == 1  # one stable line, whatever the stub
    assert lines[0].startswith(f"⏳ {exercise.name}: not attempted yet")
    assert f"{exercise.path}.hint()" in lines[0] and f"{exercise.path}.solution()" in lines[0]


@pytest.mark.parametrize(
    ("notebook", "exercises"),
    [
        ("00_start_here.ipynb", {"accumulation_steps": "ex00", "replicas": "ex00"}),
        ("01_single_device_loop.ipynb", {"accumulate_window": "ex01"}),
    ],
)
def test_the_committed_notebooks_ship_the_exercises_unsolved(
    notebook: str, exercises: dict[str, str]
) -> None:
    from notebook_exercises import assert_unsolved

    assert_unsolved(notebook, exercises)
