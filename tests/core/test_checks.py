"""checks: split_batch, compare, compare_gradients (and that it leaves the model alone)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.batches import token_batch
from helpers.gradients import grads, params, rel_error
from helpers.models import OneWeight, loss_is_output
from torch import Tensor, nn

import accumlab as al
from accumlab.checks import accumulated_gradient, full_batch_gradient
from accumlab_course.data import make_classification
from accumlab_course.models import MLP


def mlp64(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(8, 16, 3).double()


def regression_batch(n: int = 12, seed: int = 0) -> dict[str, Tensor]:
    x, labels = make_classification(n, in_features=8, out_features=3, seed=seed)
    return {"x": x.double(), "labels": labels}


# ------------------------------------------------------------------- split_batch


def test_split_batch_cuts_consecutive_rows() -> None:
    batch = {"x": torch.arange(12).reshape(6, 2), "labels": torch.arange(6)}
    pieces = al.split_batch(batch, [1, 3, 2])
    assert [p["labels"].tolist() for p in pieces] == [[0], [1, 2, 3], [4, 5]]
    assert torch.equal(torch.cat([p["x"] for p in pieces]), batch["x"])


@pytest.mark.parametrize("splits", [[2, 2], [4, 3], [], [3, 0, 2], [5, -1, 1], [2.5, 2.5]])
def test_split_batch_rejects_splits_that_do_not_cover_the_batch(splits: list) -> None:
    batch = {"labels": torch.arange(5)}
    with pytest.raises(ValueError, match="splits"):
        al.split_batch(batch, splits)


def test_split_batch_rejects_tensors_of_another_batch_size() -> None:
    batch = {"x": torch.zeros(4, 2), "labels": torch.arange(5)}
    with pytest.raises(ValueError, match=r"batch\['x'\] has shape \(4, 2\).*batch size 5"):
        al.split_batch(batch, [5])


def test_split_batch_rejects_non_mapping_and_missing_labels() -> None:
    with pytest.raises(TypeError, match="mapping"):
        al.split_batch(torch.zeros(4), [4])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'labels'"):
        al.split_batch({"x": torch.zeros(4)}, [4])


# ----------------------------------------------------------------------- compare


def test_compare_reports_abs_and_relative_errors_per_parameter() -> None:
    reference = {"a": torch.tensor([2.0, -4.0]), "b": torch.zeros(3)}
    candidate = {"a": torch.tensor([2.0, -3.0]), "b": torch.zeros(3)}
    result = al.compare(reference, candidate)
    assert result.max_abs == {"a": 1.0, "b": 0.0}
    assert result.relative == {"a": 0.25, "b": 0.0}
    assert result.max_abs_error == 1.0 and result.max_rel_error == 0.25
    assert result.ok(0.3) and not result.ok(0.2)
    assert "worst parameter: a" in str(result)


def test_compare_nonzero_against_zero_reference_is_infinite() -> None:
    result = al.compare({"a": torch.zeros(2)}, {"a": torch.tensor([0.0, 1e-30])})
    assert result.relative["a"] == float("inf") and not result.ok(1.0)


def test_compare_rejects_mismatched_names_and_shapes() -> None:
    with pytest.raises(ValueError, match="names differ.*'c'"):
        al.compare({"a": torch.zeros(1)}, {"a": torch.zeros(1), "c": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"a: shapes \(2,\) and \(3,\) differ"):
        al.compare({"a": torch.zeros(3)}, {"a": torch.zeros(2)})


# -------------------------------------------------------------- compare_gradients


def test_three_example_batch_split_2_plus_1() -> None:
    """The course's proof: the split 2+1 reproduces the full-batch mean gradient."""
    batch = {"x": torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64), "labels": torch.zeros(3)}
    objective = al.ExampleLoss(loss_is_output)
    model = OneWeight(1.0)
    assert float(full_batch_gradient(model, batch, objective)["w"]) == pytest.approx(3.0)
    assert float(accumulated_gradient(model, batch, objective, [2, 1])["w"]) == pytest.approx(3.0)
    result = al.compare_gradients(model, batch, objective, splits=[2, 1])
    assert result.max_abs_error < 1e-14 and result.ok(1e-12)

    # the average-of-averages loop gives (mean(1, 2) + mean(6)) / 2 = 3.75
    wrong = OneWeight(1.0)
    for piece in al.split_batch(batch, [2, 1]):
        (wrong(piece["x"]).mean() / 2).backward()
    bad = al.compare({"w": torch.tensor(3.0, dtype=torch.float64)}, grads(wrong))
    assert bad.max_abs_error == pytest.approx(0.75) and not bad.ok(1e-3)


def test_three_example_mlp_split_2_plus_1_is_exact_average_of_means_is_not() -> None:
    model, batch = mlp64(), regression_batch(3)
    result = al.compare_gradients(model, batch, al.ExampleLoss(), splits=[2, 1])
    assert result.ok(1e-10)

    reference = full_batch_gradient(copy.deepcopy(model), batch, al.ExampleLoss())
    wrong = copy.deepcopy(model)
    for piece in al.split_batch(batch, [2, 1]):
        (F.cross_entropy(wrong(piece["x"]), piece["labels"]) / 2).backward()
    assert rel_error(reference, grads(wrong)) > 1e-3


@pytest.mark.parametrize("splits", [[1] * 9, [4, 5], [7, 1, 1], [9]])
def test_compare_gradients_tiny_gpt_any_split(gpt64: nn.Module, splits: list[int]) -> None:
    batch = token_batch(
        [(9, 3), (5, 0), (12, 6), (4, 1), (7, 7), (10, 2), (3, 0), (11, 4), (6, 5)],
        vocab=gpt64.vocab_size,
    )
    result = al.compare_gradients(gpt64, batch, al.NextTokenLoss(), splits)
    assert result.ok(1e-10), str(result)
    assert set(result.relative) == {n for n, _ in gpt64.named_parameters()}


def test_compare_gradients_shows_average_of_averages_on_a_real_model(gpt64: nn.Module) -> None:
    """Same batch; a loop that averages per-microbatch means is off by a visible amount."""
    batch = token_batch([(12, 1), (12, 1), (3, 0), (4, 2)], vocab=gpt64.vocab_size)
    objective = al.NextTokenLoss()
    reference = full_batch_gradient(copy.deepcopy(gpt64), batch, objective)
    wrong = copy.deepcopy(gpt64)
    for piece in al.split_batch(batch, [2, 2]):
        (
            objective.loss_sum(wrong(input_ids=piece["input_ids"]), piece)
            / objective.count(piece)
            / 2
        ).backward()
    assert al.compare(reference, grads(wrong)).max_rel_error > 1e-2
    assert al.compare_gradients(gpt64, batch, objective, [2, 2]).ok(1e-10)


def test_compare_gradients_leaves_the_model_untouched(gpt64: nn.Module) -> None:
    batch = token_batch([(6, 1), (5, 0), (8, 3)], vocab=gpt64.vocab_size)
    before = params(gpt64)
    marker = {n: torch.full_like(p, 3.0) for n, p in gpt64.named_parameters()}
    for n, p in gpt64.named_parameters():
        p.grad = marker[n].clone()
    gpt64.train()
    al.compare_gradients(gpt64, batch, al.NextTokenLoss(), [2, 1])
    assert all(torch.equal(before[n], p) for n, p in gpt64.named_parameters())
    assert all(torch.equal(marker[n], p.grad) for n, p in gpt64.named_parameters())
    assert gpt64.training

    fresh = copy.deepcopy(gpt64)
    fresh.zero_grad(set_to_none=True)
    al.compare_gradients(fresh, batch, al.NextTokenLoss(), [1, 2])
    assert all(p.grad is None for p in fresh.parameters())


def test_compare_gradients_bad_splits_raise(toy64: nn.Module) -> None:
    batch = token_batch([(4, 0), (3, 0)])
    with pytest.raises(ValueError, match="add up to 3 examples but the batch has 2"):
        al.compare_gradients(toy64, batch, al.NextTokenLoss(), [2, 1])


def test_gradients_copies_and_fills_missing_with_zeros() -> None:
    model = nn.Linear(2, 1)
    model.weight.grad = torch.ones_like(model.weight)
    copied = al.gradients(model)
    model.weight.grad.mul_(5)
    assert torch.equal(copied["weight"], torch.ones(1, 2))
    assert torch.equal(copied["bias"], torch.zeros(1))
