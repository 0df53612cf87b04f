"""The notebook-02 exercise: the reference passes, the usual mistakes fail with a reason."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import accumlab as al
from accumlab.course.exercises import ex02


def _flat_ce(logits: Tensor, labels: Tensor, **kwargs: object) -> Tensor:
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), **kwargs
    )


def average_of_averages(logits: list[Tensor], labels: list[Tensor]) -> Tensor:
    return sum(_flat_ce(x, y) for x, y in zip(logits, labels, strict=True)) / len(logits)


def counts_ignored_positions(logits: list[Tensor], labels: list[Tensor]) -> Tensor:
    total = sum(y[:, 1:].numel() for y in labels)
    return sum(_flat_ce(x, y, reduction="sum") for x, y in zip(logits, labels, strict=True)) / total


def unshifted(logits: list[Tensor], labels: list[Tensor]) -> Tensor:
    total = sum(int((y != -100).sum()) for y in labels)
    return sum(
        F.cross_entropy(x.reshape(-1, x.size(-1)), y.reshape(-1), reduction="sum")
        for x, y in zip(logits, labels, strict=True)
    ) / total


def weighted_means(logits: list[Tensor], labels: list[Tensor]) -> Tensor:
    """mean × count per microbatch: right on paper, NaN for a microbatch without targets."""
    counts = [int((y[:, 1:] != -100).sum()) for y in labels]
    parts = zip(logits, labels, counts, strict=True)
    return sum(_flat_ce(x, y) * n for x, y, n in parts) / sum(counts)


def test_reference_passes(capsys):
    assert ex02.window_token_loss.check(ex02.reference_window_token_loss) is True
    assert "✅" in capsys.readouterr().out


def test_reference_matches_next_token_loss_on_uneven_microbatches():
    g = torch.Generator().manual_seed(7)
    logits = [torch.randn(2, 6, 5, generator=g), torch.randn(4, 3, 5, generator=g)]
    labels = [torch.randint(0, 5, (2, 6), generator=g), torch.randint(0, 5, (4, 3), generator=g)]
    labels[0][0, 3:] = -100
    labels[1][:, 2] = -100
    objective = al.NextTokenLoss()
    batches = [{"labels": y} for y in labels]
    expected = sum(objective.loss_sum(x, b) for x, b in zip(logits, batches, strict=True)) / sum(
        objective.count(b) for b in batches
    )
    got = ex02.reference_window_token_loss(logits, labels)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_average_of_averages_fails_and_is_named(capsys):
    assert ex02.window_token_loss.check(average_of_averages) is False
    out = capsys.readouterr().out
    assert "❌" in out and "average of the per-microbatch means" in out


def test_counting_ignored_positions_fails_and_is_named(capsys):
    assert ex02.window_token_loss.check(counts_ignored_positions) is False
    assert "ignored ones (-100) included" in capsys.readouterr().out


def test_forgetting_the_shift_fails_and_is_named(capsys):
    assert ex02.window_token_loss.check(unshifted) is False
    assert "shift" in capsys.readouterr().out


def test_nan_from_a_target_free_microbatch_fails(capsys):
    assert ex02.window_token_loss.check(weighted_means) is False
    assert "without targets made it NaN" in capsys.readouterr().out


def test_detached_result_fails(capsys):
    def detached(logits, labels):
        return ex02.reference_window_token_loss(logits, labels).detach()

    assert ex02.window_token_loss.check(detached) is False
    assert "detached" in capsys.readouterr().out


def test_non_tensor_and_non_callable_answers_fail(capsys):
    def as_float(logits, labels):
        return float(ex02.reference_window_token_loss(logits, labels).detach())

    assert ex02.window_token_loss.check(as_float) is False
    assert ex02.window_token_loss.check(3.5) is False
    out = capsys.readouterr().out
    assert "return a tensor" in out and "pass your function itself" in out


def test_wrong_gradient_with_right_value_fails(capsys):
    def scaled_gradient(logits, labels):
        right = ex02.reference_window_token_loss(logits, labels)
        return 2 * right - right.detach()  # same value, twice the gradient

    assert ex02.window_token_loss.check(scaled_gradient) is False
    assert "gradient" in capsys.readouterr().out


def test_hints_and_solution_print(capsys):
    ex02.window_token_loss.hint(3)
    ex02.window_token_loss.solution()
    out = capsys.readouterr().out
    assert "hint 3/3" in out
    assert "def reference_window_token_loss" in out and "reduction=\"sum\"" in out


def test_the_printed_numbers_are_rounded_to_stable_digits(capsys):
    """The verdict is compared by strict nbval: float32 sums may change the 6th decimal
    from run to run, so the checker prints 4 significant digits."""
    assert ex02.window_token_loss.check(average_of_averages) is False
    out = capsys.readouterr().out
    assert "you returned 2.829, the window's token mean is 2.854" in out


def test_forgetting_to_divide_fails_and_is_named(capsys):
    def window_sum(logits, labels):
        return sum(_flat_ce(x, y, reduction="sum") for x, y in zip(logits, labels, strict=True))

    assert ex02.window_token_loss.check(window_sum) is False
    assert "without dividing by its target count" in capsys.readouterr().out


def test_an_average_that_skips_empty_microbatches_is_still_an_average_of_averages(capsys):
    def skips_empty(logits, labels):
        means = [_flat_ce(x, y) for x, y in zip(logits, labels, strict=True)
                 if bool((y[:, 1:] != -100).any())]
        return sum(means) / len(means)

    assert ex02.window_token_loss.check(skips_empty) is False
    assert "average of the per-microbatch means" in capsys.readouterr().out


def test_a_stub_is_not_attempted_yet(capsys):
    def stub(logits, labels):
        raise NotImplementedError("your code here")

    for answer in (stub, None, ...):
        assert ex02.window_token_loss.check(answer) is False
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and len(set(lines)) == 1  # the same stable line each time
    assert lines[0].startswith("⏳ window_token_loss: not attempted yet")
    assert "ex02.window_token_loss.hint()" in lines[0]
    assert "ex02.window_token_loss.solution()" in lines[0]


def test_the_committed_notebook_ships_the_exercise_unsolved():
    from notebook_exercises import assert_unsolved

    assert_unsolved("02_token_weighting.ipynb", {"window_token_loss": "ex02"})
