"""The notebook-02 exercise: the reference passes, the usual mistakes fail with a reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import accumlab as al
from accumlab_course.exercises import ex02


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
    assert "✓" in capsys.readouterr().out


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
    assert "✗" in out and "average of the per-microbatch means" in out


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
    assert lines[0].startswith("○ window_token_loss: not attempted yet")
    assert "ex02.window_token_loss.hint()" in lines[0]
    assert "ex02.window_token_loss.solution()" in lines[0]



# --- window_token_loss on a window without any target ------------------------------------


def test_a_window_without_targets_must_give_none(capsys):
    def nan_for_empty(logits, labels):
        total = sum(int((y[:, 1:] != -100).sum()) for y in labels)
        return sum(_flat_ce(x, y, reduction="sum") for x, y in zip(logits, labels, strict=True)) / max(total, 0.0)

    def divides_by_zero(logits, labels):
        total = sum(int((y[:, 1:] != -100).sum()) for y in labels)
        return sum(_flat_ce(x, y, reduction="sum") for x, y in zip(logits, labels, strict=True)) / (1 / total) ** -1

    assert ex02.window_token_loss.check(nan_for_empty) is False
    assert "window without any target you returned nan" in capsys.readouterr().out
    assert ex02.window_token_loss.check(divides_by_zero) is False
    assert "raised ZeroDivisionError" in capsys.readouterr().out
    assert ex02.reference_window_token_loss([torch.randn(1, 3, 4)], [torch.full((1, 3), -100)]) is None


# --- window_weighted_loss (transfer) -------------------------------------------------------


def _token_losses(x, y):
    return F.cross_entropy(x[:, :-1].reshape(-1, x.size(-1)), y[:, 1:].reshape(-1),
                           reduction="none").view(y[:, 1:].shape)


def _parts(logits, labels, weights):
    return list(zip(logits, labels, weights, strict=True))


def weighted_by_targets(logits, labels, weights):
    total = sum(int((y[:, 1:] != -100).sum()) for y in labels)
    return sum((w[:, None] * _token_losses(x, y)).sum() for x, y, w in _parts(logits, labels, weights)) / total


def weighted_by_row_weights(logits, labels, weights):
    total = sum(float(w.sum()) for w in weights)
    return sum((w[:, None] * _token_losses(x, y)).sum() for x, y, w in _parts(logits, labels, weights)) / total


def weighted_means_averaged(logits, labels, weights):
    means = []
    for x, y, w in _parts(logits, labels, weights):
        n = float((w * (y[:, 1:] != -100).sum(dim=1)).sum())
        if n > 0:
            means.append((w[:, None] * _token_losses(x, y)).sum() / n)
    return sum(means) / len(means)


def weighted_means_nan(logits, labels, weights):
    parts = _parts(logits, labels, weights)
    sums = [(w[:, None] * _token_losses(x, y)).sum() / (w * (y[:, 1:] != -100).sum(dim=1)).sum()
            for x, y, w in parts]
    return sum(sums) / len(sums)


def weighted_sum(logits, labels, weights):
    return sum((w[:, None] * _token_losses(x, y)).sum() for x, y, w in _parts(logits, labels, weights))


def test_reference_weighted_loss_passes_and_matches_a_full_batch(capsys):
    assert ex02.window_weighted_loss.check(ex02.reference_window_weighted_loss) is True
    assert "✓ window_weighted_loss" in capsys.readouterr().out
    # the same rows as one batch: sum(w × loss) / sum(w × targets); weights 1 give the token mean
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(5, 6, 7, generator=g), torch.randint(0, 7, (5, 6), generator=g)
    y[1] = -100
    y[3, 3:] = -100
    w = torch.tensor([1.0, 2.0, 0.5, 3.0, 0.0])
    loss = _token_losses(x, y)
    expected = (w[:, None] * loss).sum() / (w * (y[:, 1:] != -100).sum(dim=1)).sum()
    got = ex02.reference_window_weighted_loss([x[:2], x[2:]], [y[:2], y[2:]], [w[:2], w[2:]])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    ones = ex02.reference_window_weighted_loss([x[:2], x[2:]], [y[:2], y[2:]],
                                               [torch.ones(2), torch.ones(3)])
    torch.testing.assert_close(ones, ex02.reference_window_token_loss([x[:2], x[2:]], [y[:2], y[2:]]))


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (lambda x, y, w: ex02.reference_window_token_loss(x, y), "the weights were left out"),
        (weighted_by_targets, "divided by the plain target count"),
        (weighted_by_row_weights, "divided by the sum of the row weights"),
        (weighted_means_averaged, "average of averages again"),
        (weighted_means_nan, "has the mean 0/0"),
        (weighted_sum, "without dividing"),
    ],
)
def test_wrong_weighted_losses_are_named(answer, reason, capsys):
    assert ex02.window_weighted_loss.check(answer) is False
    out = capsys.readouterr().out
    assert out.startswith("✗ window_weighted_loss:") and reason in out, out


def test_a_window_of_zero_weight_must_give_none(capsys):
    def nan_when_empty(logits, labels, weights):
        got = ex02.reference_window_weighted_loss(logits, labels, weights)
        return torch.tensor(float("nan")) if got is None else got

    assert ex02.window_weighted_loss.check(nan_when_empty) is False
    assert "weights are all 0 you returned nan" in capsys.readouterr().out


# --- predictions ---------------------------------------------------------------------------


def test_number_prediction_second_contribution(capsys):
    assert ex02.second_contribution.check(2.25)
    for wrong, reason in ((3, "own mean"), (1.5, "average of averages"), (18, "undivided"),
                          (2.5, "both microbatches")):
        assert not ex02.second_contribution.check(wrong)
        assert reason in capsys.readouterr().out.splitlines()[-1]
    assert ex02.SECOND_CONTRIBUTION == 18 / (2 + 6)


@pytest.mark.parametrize(
    ("exercise", "right", "wrong"),
    [
        (ex02.same_direction, "Positions  counted", {"average of averages": "direction changes",
                                                     "both": "only one", "neither": "same factor"}),
        (ex02.better_on_short_answers, "average-of-averages", {"token mean": "half of every update"}),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_choice_predictions(exercise, right, wrong, capsys):
    assert exercise.check(right)  # case, spaces and hyphens do not matter
    for choice, reason in wrong.items():
        assert not exercise.check(choice)
        assert reason in capsys.readouterr().out.splitlines()[-1]
    assert not exercise.check("the first one")
    assert "write one of" in capsys.readouterr().out


def test_the_committed_notebook_ships_every_02_exercise_unsolved():
    from helpers.notebook_exercises import assert_unsolved

    assert_unsolved("02_token_weighting.ipynb", {
        "window_token_loss": "ex02", "window_weighted_loss": "ex02",
        "second_contribution": "ex02", "same_direction": "ex02",
        "better_on_short_answers": "ex02",
    })


@pytest.mark.parametrize(
    "exercise",
    [ex02.window_weighted_loss, ex02.second_contribution, ex02.same_direction,
     ex02.better_on_short_answers],
    ids=lambda e: e.name,
)
def test_stubs_of_the_new_exercises_are_not_attempted_yet(exercise, capsys):
    for answer in (None, ...):
        assert exercise.check(answer) is False
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(set(lines)) == 1 and lines[0].startswith(f"○ {exercise.name}: not attempted yet")
