"""Objectives: what NextTokenLoss and ExampleLoss count and sum, and their bad-input errors."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.batches import level_batch, targets_of, token_batch
from helpers.models import IGNORE, LevelLM, small_gpt

import accumlab as al
from accumlab.memory import MemoryMeter
from accumlab.objectives import check_batch, count_window, logits_of
from accumlab_course.data import VOCAB_SIZE

# ------------------------------------------------------------------ NextTokenLoss.count


def test_count_is_targets_after_the_shift() -> None:
    labels = torch.tensor(
        [
            [5, 6, 7, 8],  # position 0 is never a target: 3 targets
            [IGNORE, IGNORE, 7, 8],  # prompt masked: 2 targets
            [5, 6, IGNORE, IGNORE],  # right padding: 1 target
        ]
    )
    assert al.NextTokenLoss().count({"labels": labels}) == 6


def test_count_uses_ignore_index() -> None:
    labels = torch.tensor([[0, 1, 0, 2]])
    assert al.NextTokenLoss(ignore_index=0).count({"labels": labels}) == 2
    assert al.NextTokenLoss().count({"labels": labels}) == 3


def test_count_of_fully_masked_batch_is_zero() -> None:
    assert al.NextTokenLoss().count({"labels": torch.full((3, 5), IGNORE)}) == 0


def test_count_window_counts_each_microbatch_on_cpu() -> None:
    window = [token_batch([(6, 2), (3, 0)]), token_batch([(4, 4)]), token_batch([(9, 1)])]
    counts = count_window(al.NextTokenLoss(), window)
    # (length 6, prompt 2): targets at 2..5 = 4; (3, 0): 1..2 = 2; prompt covers all; 1..8 = 8
    assert counts == [targets_of(mb) for mb in window] == [4 + 2, 0, 8]
    assert isinstance(counts[0], int)


# --------------------------------------------------------------- NextTokenLoss.loss_sum


def test_loss_sum_matches_summed_cross_entropy_over_counted_targets() -> None:
    torch.manual_seed(0)
    batch = token_batch([(7, 3), (5, 0), (2, 2)], vocab=11)
    logits = torch.randn(3, 7, 11)
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, 11), batch["labels"][:, 1:].reshape(-1), reduction="sum"
    )
    objective = al.NextTokenLoss()
    got = objective.loss_sum(logits, batch)
    assert got.dim() == 0
    assert torch.allclose(got, expected, rtol=1e-6)
    # the per-target mean is loss_sum / count
    mean = F.cross_entropy(logits[:, :-1].reshape(-1, 11), batch["labels"][:, 1:].reshape(-1))
    assert torch.allclose(got / objective.count(batch), mean, rtol=1e-6)


def test_loss_sum_accepts_output_with_logits_attribute_and_mapping() -> None:
    batch = token_batch([(4, 0)], vocab=5)
    logits = torch.randn(1, 4, 5)
    objective = al.NextTokenLoss()
    plain = objective.loss_sum(logits, batch)
    assert torch.equal(objective.loss_sum(SimpleNamespace(logits=logits), batch), plain)
    assert torch.equal(objective.loss_sum({"logits": logits}, batch), plain)


def test_loss_sum_keeps_float64_and_upcasts_half() -> None:
    batch = token_batch([(4, 0), (3, 1)], vocab=5)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    objective = al.NextTokenLoss()
    assert objective.loss_sum(logits, batch).dtype == torch.float64
    assert objective.loss_sum(logits.to(torch.bfloat16), batch).dtype == torch.float32


def test_worked_example_512_times_2_plus_1536_times_4() -> None:
    """Token mean (512·2 + 1536·4) / 2048 = 3.5; the average of the two means is 3."""
    objective = al.NextTokenLoss()
    model = LevelLM()
    # 2 rows × 256 targets at loss 2 (prompt of 4 masked), 6 rows × 256 targets at loss 4
    short = level_batch([[2] * 259] * 2, [[t >= 3 for t in range(259)]] * 2)
    long = level_batch([[4] * 259] * 6, [[t >= 3 for t in range(259)]] * 6)
    assert (objective.count(short), objective.count(long)) == (512, 1536)

    sums = [float(objective.loss_sum(model(mb["input_ids"]), mb).detach()) for mb in (short, long)]
    assert sums == pytest.approx([512 * 2, 1536 * 4], rel=1e-12)
    token_mean = sum(sums) / (512 + 1536)
    average_of_means = (sums[0] / 512 + sums[1] / 1536) / 2
    assert token_mean == pytest.approx(3.5, rel=1e-12)
    assert average_of_means == pytest.approx(3.0, rel=1e-12)


def test_worked_example_sums_2_and_18_over_8_targets() -> None:
    objective = al.NextTokenLoss()
    model = LevelLM()
    first = level_batch([[1, 1, 1]], [[True, True, False]])  # 2 targets at loss 1: sum 2
    second = level_batch([[3, 3, 3, 3]] * 2, [[True, True, True, False]] * 2)  # 6 at 3: 18
    counts = count_window(objective, [first, second])
    sums = [
        float(objective.loss_sum(model(mb["input_ids"]), mb).detach()) for mb in (first, second)
    ]
    assert counts == [2, 6]
    assert sums == pytest.approx([2.0, 18.0], rel=1e-12)
    assert sum(sums) / sum(counts) == pytest.approx(2.5, rel=1e-12)


# --------------------------------------------------------------------- ExampleLoss


def test_example_loss_counts_rows() -> None:
    assert al.ExampleLoss().count({"labels": torch.zeros(5, dtype=torch.long)}) == 5
    assert al.ExampleLoss("mse").count({"labels": torch.zeros(3, 4)}) == 3


def test_example_loss_cross_entropy_sum() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 4), torch.randint(0, 4, (6,))
    got = al.ExampleLoss().loss_sum(logits, {"labels": labels})
    assert torch.allclose(got, F.cross_entropy(logits, labels, reduction="sum"), rtol=1e-6)


def test_example_loss_mse_averages_features_then_sums_examples() -> None:
    prediction = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 3.0]])
    target = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 3.0]])
    # per-example means over features: (0 + 4)/2, (1 + 1)/2, (9 + 0)/2 = 2, 1, 4.5
    got = al.ExampleLoss("mse").loss_sum(prediction, {"labels": target})
    assert float(got) == pytest.approx(7.5)


def test_example_loss_callable_and_float64() -> None:
    objective = al.ExampleLoss(lambda out, labels: (out.squeeze(1) - labels) ** 2)
    prediction = torch.tensor([[1.0], [4.0]], dtype=torch.float64)
    got = objective.loss_sum(prediction, {"labels": torch.tensor([0.0, 2.0], dtype=torch.float64)})
    assert got.dtype == torch.float64 and float(got) == 5.0
    assert al.ExampleLoss("mse").loss_sum(prediction, {"labels": prediction}).dtype == torch.float64


def test_objectives_satisfy_the_protocol() -> None:
    assert isinstance(al.NextTokenLoss(), al.Objective)
    assert isinstance(al.ExampleLoss(), al.Objective)
    assert al.NextTokenLoss().unit == "target" and al.ExampleLoss().unit == "example"
    assert "ignore_index=-7" in repr(al.NextTokenLoss(-7))
    assert "mse" in repr(al.ExampleLoss("mse"))


# --------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("objective", [al.NextTokenLoss(), al.ExampleLoss()])
@pytest.mark.parametrize("batch", [torch.zeros(2, 3, dtype=torch.long), [1, 2], "batch"])
def test_batch_that_is_not_a_mapping_raises_type_error(
    objective: al.Objective, batch: object
) -> None:
    with pytest.raises(TypeError, match="must be a mapping of tensors"):
        objective.count(batch)  # type: ignore[arg-type]


@pytest.mark.parametrize("objective", [al.NextTokenLoss(), al.ExampleLoss()])
def test_batch_without_labels_raises_value_error(objective: al.Objective) -> None:
    with pytest.raises(ValueError, match="no 'labels' entry.*input_ids"):
        objective.count({"input_ids": torch.zeros(2, 3, dtype=torch.long)})


def test_labels_that_are_not_a_tensor_raise() -> None:
    with pytest.raises(TypeError, match=r"\['labels'\] must be a tensor"):
        check_batch({"labels": [[1, 2, 3]]})


def test_next_token_labels_must_be_2d_integers() -> None:
    with pytest.raises(ValueError, match=r"shape \(batch, sequence\)"):
        al.NextTokenLoss().count({"labels": torch.zeros(4, dtype=torch.long)})
    with pytest.raises(TypeError, match="integer token ids"):
        al.NextTokenLoss().count({"labels": torch.zeros(2, 4)})


@pytest.mark.parametrize(
    "shape", [(2, 5, 7), (3, 4, 7), (2, 4)], ids=["sequence", "batch", "no-vocab"]
)
def test_logits_labels_shape_mismatch_raises(shape: tuple[int, ...]) -> None:
    batch = {"labels": torch.zeros(2, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"do not match labels of shape \(2, 4\)"):
        al.NextTokenLoss().loss_sum(torch.zeros(shape), batch)


def test_example_loss_row_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="3 rows but labels have 2"):
        al.ExampleLoss().loss_sum(torch.zeros(3, 4), {"labels": torch.zeros(2, dtype=torch.long)})


def test_example_loss_callable_with_wrong_shape_raises() -> None:
    objective = al.ExampleLoss(lambda out, labels: out.sum())
    with pytest.raises(ValueError, match=r"must return shape \(2,\).*reduction='none'"):
        objective.loss_sum(torch.zeros(2, 3), {"labels": torch.zeros(2)})


def test_example_loss_zero_d_labels_raise() -> None:
    with pytest.raises(ValueError, match="batch dimension"):
        al.ExampleLoss().count({"labels": torch.tensor(1)})


def test_bad_objective_arguments_raise() -> None:
    with pytest.raises(ValueError, match="loss must be one of"):
        al.ExampleLoss("hinge")
    with pytest.raises(TypeError, match="string or a callable"):
        al.ExampleLoss(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        al.NextTokenLoss(ignore_index=-100.0)  # type: ignore[arg-type]


def test_output_without_logits_raises() -> None:
    with pytest.raises(TypeError, match="forward=..."):
        logits_of(SimpleNamespace(hidden=torch.zeros(1)))
    with pytest.raises(TypeError, match="neither a tensor"):
        logits_of({"scores": torch.zeros(1)})
    assert math.isclose(float(logits_of({"logits": torch.ones(())})), 1.0)


# ------------------------------------------- label dtypes and exact shapes


def test_mse_output_with_a_trailing_one_against_flat_labels_is_a_shape_error() -> None:
    # (4, 1) against (4,) would broadcast to (4, 4): every prediction against every label.
    prediction = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    labels = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match=r"\(4, 1\).*\(4,\)"):
        al.ExampleLoss("mse").loss_sum(prediction, {"labels": labels})
    # Matching shapes give the exact per-example loss (here zero).
    got = al.ExampleLoss("mse").loss_sum(prediction, {"labels": labels[:, None]})
    assert float(got) == 0.0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_integer_labels_give_the_int64_result(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    batch = token_batch([(6, 2), (4, 0)], vocab=7)
    narrow = {**batch, "labels": batch["labels"].clamp(min=0).to(dtype)}
    wide = {**batch, "labels": narrow["labels"].long()}
    logits = torch.randn(2, 6, 7)
    objective = al.NextTokenLoss(ignore_index=0)
    assert objective.count(narrow) == objective.count(wide)
    assert torch.equal(objective.loss_sum(logits, narrow), objective.loss_sum(logits, wide))
    classes = torch.randint(0, 4, (5,))
    scores = torch.randn(5, 4)
    example = al.ExampleLoss()
    assert torch.equal(
        example.loss_sum(scores, {"labels": classes.to(dtype)}),
        example.loss_sum(scores, {"labels": classes}),
    )


NOT_CLASS_INDICES = r"labels must hold integer class indices.*torch.bool.*labels.long\(\)"


def test_bool_labels_are_a_clear_type_error() -> None:
    flags = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match=NOT_CLASS_INDICES):
        al.NextTokenLoss().count({"labels": flags})
    with pytest.raises(TypeError, match=NOT_CLASS_INDICES):
        al.NextTokenLoss().loss_sum(torch.zeros(2, 4, 3), {"labels": flags})
    with pytest.raises(TypeError, match=NOT_CLASS_INDICES):
        al.ExampleLoss().loss_sum(torch.zeros(2, 3), {"labels": flags[:, 0]})


# ---------------------------------------- the loss reads the logits in place


def sliced_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore: int = IGNORE) -> torch.Tensor:
    """The formulation NextTokenLoss used before: slice the logits, then flatten them
    (a copy of the logits for more than one row, and a float32 copy of half logits)."""
    predictions = logits[:, :-1]
    return F.cross_entropy(
        predictions.reshape(-1, predictions.size(-1)).float()
        if predictions.dtype != torch.float64
        else predictions.reshape(-1, predictions.size(-1)),
        labels[:, 1:].reshape(-1),
        ignore_index=ignore,
        reduction="sum",
    )


def _gpt_loss_and_grads(
    dtype: torch.dtype, loss_fn: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = small_gpt(dtype)
    batch = token_batch([(9, 3), (5, 0), (12, 6), (7, 7)], vocab=VOCAB_SIZE, seed=3)
    logits = model(input_ids=batch["input_ids"]).logits
    loss = loss_fn(logits, batch)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_loss_sum_equals_the_sliced_formulation_on_the_tiny_gpt(
    dtype: torch.dtype, tol: float
) -> None:
    new_loss, new_grads = _gpt_loss_and_grads(dtype, al.NextTokenLoss().loss_sum)
    old_loss, old_grads = _gpt_loss_and_grads(dtype, lambda z, b: sliced_loss_sum(z, b["labels"]))
    torch.testing.assert_close(new_loss, old_loss, rtol=tol, atol=0)
    for new, old in zip(new_grads, old_grads, strict=True):
        torch.testing.assert_close(new, old, rtol=tol, atol=tol * float(old.abs().max()))


def test_half_logits_give_the_float32_loss_of_the_upcast_logits() -> None:
    torch.manual_seed(0)
    batch = token_batch([(9, 3), (5, 0), (12, 6)], vocab=50)
    logits = torch.randn(3, 12, 50).to(torch.bfloat16)
    got = al.NextTokenLoss().loss_sum(logits, batch)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, sliced_loss_sum(logits, batch["labels"]), rtol=1e-6, atol=0)


def _extra_peak(loss_fn: Any, logits: torch.Tensor) -> int:
    meter = MemoryMeter("cpu")
    meter.watch(logits)  # a leaf that requires grad would otherwise count once it is read
    with meter.track():
        start = meter.live_bytes
        loss = loss_fn(logits)
        extra = meter.peak_bytes - start
    del loss
    return extra


def test_loss_sum_adds_one_float32_logits_buffer_and_no_copy() -> None:
    torch.manual_seed(0)
    batch = token_batch([(64, 0)] * 4, vocab=1000)
    logits = torch.randn(4, 64, 1000, requires_grad=True)
    new = _extra_peak(lambda z: al.NextTokenLoss().loss_sum(z, batch), logits)
    old = _extra_peak(lambda z: sliced_loss_sum(z, batch["labels"]), logits)
    # The log-softmax (saved for backward) is the one logits-sized buffer; labels are small.
    assert new <= 1.05 * logits.nbytes
    assert old >= 1.9 * logits.nbytes  # the old slice-and-flatten copied the logits once more
