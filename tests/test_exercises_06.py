"""Tests for the exercise checker of notebook 06: the reference passes, the usual wrong
answers fail with a message that names the mistake, a stub reads as not attempted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import accumlab as al
from accumlab.course.data import VOCAB_SIZE, collate, load_examples
from accumlab.course.exercises import NOT_ATTEMPTED, ex06

torch.set_num_threads(1)

Window = Sequence[Mapping[str, Tensor]]


def _sequence_sum(model: nn.Module, mb: Mapping[str, Tensor], losses: Any) -> Tensor:
    return losses(model(mb["input_ids"]).logits, mb["labels"]).sum()


def token_weighted(model: nn.Module, window: Window, losses: Any) -> None:
    objective = al.NextTokenLoss()
    al.accumulate(model, window, objective)


def average_of_means(model: nn.Module, window: Window, losses: Any) -> None:
    for mb in window:
        (_sequence_sum(model, mb, losses) / mb["labels"].shape[0] / len(window)).backward()


def sum_of_means(model: nn.Module, window: Window, losses: Any) -> None:
    for mb in window:
        (_sequence_sum(model, mb, losses) / mb["labels"].shape[0]).backward()


def no_division(model: nn.Module, window: Window, losses: Any) -> None:
    for mb in window:
        _sequence_sum(model, mb, losses).backward()


def double_division(model: nn.Module, window: Window, losses: Any) -> None:
    total = sum(mb["labels"].shape[0] for mb in window)
    for mb in window:
        (_sequence_sum(model, mb, losses) / total / len(window)).backward()


def zero_grad_inside(model: nn.Module, window: Window, losses: Any) -> None:
    total = sum(mb["labels"].shape[0] for mb in window)
    for mb in window:
        model.zero_grad(set_to_none=True)
        (_sequence_sum(model, mb, losses) / total).backward()


def steps_inside(model: nn.Module, window: Window, losses: Any) -> None:
    ex06.reference_sequence_weighted_window(model, window, losses)
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def does_nothing(model: nn.Module, window: Window, losses: Any) -> None:
    return None


def slightly_off(model: nn.Module, window: Window, losses: Any) -> None:
    total = sum(mb["labels"].shape[0] for mb in window)
    for mb in window:
        (_sequence_sum(model, mb, losses) / (total + 1)).backward()


def test_reference_passes(capsys: Any) -> None:
    assert ex06.sequence_weighted_window.check(ex06.reference_sequence_weighted_window)
    assert "✅ sequence_weighted_window: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (token_weighted, "token-weighted gradient"),
        (average_of_means, "average of the microbatch means"),
        (sum_of_means, "sum of the microbatch means"),
        (no_division, "times the right gradient"),
        (double_division, "you divided twice"),
        (zero_grad_inside, "only the last microbatch"),
        (steps_inside, "the weights changed"),
        (does_nothing, "no gradient at all"),
        (slightly_off, "differs from the sequence-weighted full batch"),
        ("not a function", "expected a function"),
    ],
)
def test_wrong_answers_fail_with_the_named_mistake(answer: Any, reason: str, capsys: Any) -> None:
    message = ex06.check_sequence_weighted_window(answer)
    assert message is not None and reason in message
    assert not ex06.sequence_weighted_window.check(answer)
    assert "❌" in capsys.readouterr().out


def test_a_stub_is_not_attempted(capsys: Any) -> None:
    def stub(model: nn.Module, window: Window, losses: Any) -> None:
        raise NotImplementedError

    assert not ex06.sequence_weighted_window.check(stub)
    out = capsys.readouterr().out
    assert out.startswith("⏳ sequence_weighted_window: " + NOT_ATTEMPTED)
    assert "ex06.sequence_weighted_window.hint()" in out


def test_checker_leaves_the_global_random_state_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ex06.check_sequence_weighted_window(ex06.reference_sequence_weighted_window)
    assert torch.equal(torch.rand(3), expected)


def test_sequence_losses_is_each_rows_token_mean() -> None:
    batch = collate(load_examples(limit=3))
    logits = torch.randn(*batch["input_ids"].shape, VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    got = ex06.sequence_losses(logits, batch["labels"])
    objective = al.NextTokenLoss()
    for row in range(3):
        one = {k: v[row : row + 1] for k, v in batch.items()}
        expected = objective.loss_sum(logits[row : row + 1], one) / objective.count(one)
        torch.testing.assert_close(got[row], expected)


def test_sequence_losses_rejects_a_sequence_without_targets() -> None:
    labels = torch.tensor([[5, 6, 7], [-100, -100, -100]])
    with pytest.raises(ValueError, match="no supervised target"):
        ex06.sequence_losses(torch.zeros(2, 3, 10), labels)
    with pytest.raises(ValueError, match=r"\(batch, seq, vocab\)"):
        ex06.sequence_losses(torch.zeros(2, 3), labels)


def test_hints_and_solution_print(capsys: Any) -> None:
    ex06.sequence_weighted_window.hint(3)
    ex06.sequence_weighted_window.solution()
    out = capsys.readouterr().out
    assert "hint 3/3" in out and "def reference_sequence_weighted_window" in out
