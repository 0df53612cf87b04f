"""The reference loop: accumulate, train_window and train.

Worked numbers from the course are planted in tiny models whose gradients are known in
closed form (see conftest: OneWeight, LevelLM), and read back from the loop's report and
from the weights after an SGD update with learning rate 1 (weight change = −gradient).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from helpers.batches import level_batch, rows, targets_of, token_batch, trim
from helpers.gradients import capture, grads, params, rel_error, token_mean_gradient
from helpers.models import IGNORE, LevelLM, OneWeight, loss_is_output, small_gpt
from torch import Tensor, nn

import accumlab as al
from accumlab_course.data import VOCAB_SIZE, load_examples, microbatches

# --------------------------------------------------------------------- helpers


def xs(*values: float) -> dict[str, Tensor]:
    """An ExampleLoss microbatch for OneWeight: inputs ``values``, dummy labels."""
    x = torch.tensor(values, dtype=torch.float64)
    return {"x": x, "labels": torch.zeros_like(x)}


def sgd(model: nn.Module, lr: float = 1.0) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr)


def gpt_window(seed: int = 0) -> list[dict[str, Tensor]]:
    """Three trimmed microbatches of sizes 2, 3, 1 with prompts and padding."""
    full = token_batch(
        [(9, 3), (5, 0), (12, 6), (4, 1), (7, 7), (10, 2)], vocab=VOCAB_SIZE, seed=seed
    )
    return [trim(rows(full, 0, 2)), trim(rows(full, 2, 5)), trim(rows(full, 5, 6))]


class RecordingMeter:
    """A meter that records the phases the loop opens, in order."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, int | None]] = []

    def phase(self, name: str, microbatch: int | None = None) -> Any:
        self.phases.append((name, microbatch))
        return torch.autograd.profiler.record_function(name)  # any context manager


# ------------------------------------------------------------ worked numbers (course)


def test_one_weight_means_2_minus1_3_4_give_2_not_8() -> None:
    """Four equal-size microbatches with mean gradients 2, −1, 3, 4."""
    window = [xs(1.0, 3.0), xs(0.0, -2.0), xs(3.0, 3.0), xs(5.0, 3.0)]
    means = [float(mb["x"].mean()) for mb in window]
    assert means == [2.0, -1.0, 3.0, 4.0]

    model = OneWeight(init=1.0)
    report = al.train_window(model, window, sgd(model), al.ExampleLoss(loss_is_output))
    # the loop's gradient is the mean 2, so SGD with lr 1 moves w from 1 to -1
    assert float(model.w.detach()) == pytest.approx(1.0 - 2.0, abs=1e-12)
    assert report.applied and report.examples == 8 and report.targets == 8
    assert report.loss == pytest.approx(2.0, abs=1e-12)  # at w = 1 the loss is the mean of x
    assert report.grad_norm == pytest.approx(2.0, abs=1e-12)

    # the two hand-written variants the notebook contrasts
    summed, divided = OneWeight(1.0), OneWeight(1.0)
    for mb in window:
        summed(mb["x"]).mean().backward()  # forgot to divide by A
        (divided(mb["x"]).mean() / len(window)).backward()  # equal sizes: ÷ A is right
    assert float(summed.w.grad) == pytest.approx(8.0)
    assert float(divided.w.grad) == pytest.approx(2.0)


def test_token_mean_3_5_not_average_of_averages_3() -> None:
    """512 targets at loss 2 and 1536 at loss 4: one window gives 3.5, two means give 3."""
    supervised = [t >= 3 for t in range(259)]  # 256 targets per row
    short = level_batch([[2] * 259] * 2, [supervised] * 2)
    long = level_batch([[4] * 259] * 6, [supervised] * 6)

    model = LevelLM()
    report = al.train_window(model, [short, long], sgd(model), al.NextTokenLoss())
    assert (report.targets, report.global_targets, report.examples) == (2048, 2048, 8)
    assert report.loss_sum == pytest.approx(512 * 2 + 1536 * 4, rel=1e-12)
    assert report.loss == pytest.approx(3.5, rel=1e-12)
    # d(loss)/dw is the mean level, 3.5 too: w moves from 1 to -2.5
    assert float(model.w.detach()) == pytest.approx(1.0 - 3.5, rel=1e-12)

    # averaging each microbatch's mean instead (each as its own window)
    means = [
        al.train_window(m := LevelLM(), [mb], sgd(m), al.NextTokenLoss()).loss
        for mb in (short, long)
    ]
    assert means == pytest.approx([2.0, 4.0], rel=1e-12)
    assert sum(means) / 2 == pytest.approx(3.0, rel=1e-12)


def test_sums_2_and_18_over_8_targets_give_2_5() -> None:
    first = level_batch([[1, 1, 1]], [[True, True, False]])  # 2 targets, loss sum 2
    second = level_batch([[3, 3, 3, 3]] * 2, [[True, True, True, False]] * 2)  # 6, sum 18
    model = LevelLM()
    acc = al.accumulate(model, [first, second], al.NextTokenLoss())
    assert acc.counts == [2, 6] and acc.global_count == 8 and acc.data_parallel_size == 1
    assert acc.backward_passes == 2
    assert acc.loss_sum == pytest.approx(20.0, rel=1e-12)
    assert acc.loss_sum / acc.global_count == pytest.approx(2.5, rel=1e-12)
    assert float(model.w.grad) == pytest.approx(2.5, rel=1e-12)  # mean level (2·1 + 6·3)/8


def test_three_examples_split_2_plus_1_equal_the_full_batch() -> None:
    """Each microbatch's sum / 3 reproduces the mean; averaging the two means does not."""
    x = [1.0, 2.0, 6.0]
    full = OneWeight(1.0)
    full(torch.tensor(x, dtype=torch.float64)).mean().backward()
    assert float(full.w.grad) == pytest.approx(3.0)

    model = OneWeight(1.0)
    al.accumulate(model, [xs(1.0, 2.0), xs(6.0)], al.ExampleLoss(loss_is_output))
    assert float(model.w.grad) == pytest.approx(float(full.w.grad), abs=1e-14)

    avg = OneWeight(1.0)
    for mb in (xs(1.0, 2.0), xs(6.0)):
        (avg(mb["x"]).mean() / 2).backward()
    assert float(avg.w.grad) == pytest.approx((1.5 + 6.0) / 2)  # 3.75, not 3


# ---------------------------------------------------------------- train_window


def test_train_window_equals_one_full_batch_sgd_step(gpt64: nn.Module) -> None:
    window = gpt_window()
    reference = copy.deepcopy(gpt64)
    ref_grad = token_mean_gradient(reference, window)
    before = params(gpt64)

    report = al.train_window(gpt64, window, sgd(gpt64, lr=0.5), al.NextTokenLoss())
    after = params(gpt64)
    step = {n: (before[n] - after[n]) / 0.5 for n in before}
    assert rel_error(ref_grad, step) < 1e-9
    assert report.applied and report.skipped_reason is None
    assert report.backward_passes == 3
    assert report.targets == sum(targets_of(mb) for mb in window)
    assert report.examples == 6
    assert report.lr == 0.5
    assert all(p.grad is None for p in gpt64.parameters())  # cleared after the step


def test_train_window_hands_the_optimizer_the_token_mean_gradient_float32() -> None:
    model = small_gpt(torch.float32)
    window = gpt_window(seed=3)
    ref = token_mean_gradient(copy.deepcopy(model), window)
    optimizer = capture(model)
    al.train_window(model, window, optimizer, al.NextTokenLoss())
    assert len(optimizer.seen) == 1
    assert rel_error(ref, optimizer.seen[0]) < 1e-5


def test_train_window_clears_stale_gradients_first(gpt64: nn.Module) -> None:
    window = gpt_window()
    ref = token_mean_gradient(copy.deepcopy(gpt64), window)
    for p in gpt64.parameters():
        p.grad = torch.full_like(p, 7.0)  # left over from somewhere else
    optimizer = capture(gpt64)
    al.train_window(gpt64, window, optimizer, al.NextTokenLoss())
    assert rel_error(ref, optimizer.seen[0]) < 1e-10


def test_accumulate_adds_to_existing_gradients(toy64: nn.Module) -> None:
    window = [token_batch([(5, 1), (3, 0)], seed=1), token_batch([(6, 2)], seed=2)]
    al.accumulate(toy64, window, al.NextTokenLoss())
    once = grads(toy64)
    al.accumulate(toy64, window, al.NextTokenLoss())
    twice = grads(toy64)
    assert rel_error({n: 2 * g for n, g in once.items()}, twice) < 1e-12


def test_accumulate_rejects_an_empty_window(toy64: nn.Module) -> None:
    with pytest.raises(ValueError, match="window is empty"):
        al.accumulate(toy64, [], al.NextTokenLoss())


def test_zero_target_window_is_not_an_update(toy64: nn.Module) -> None:
    empty = token_batch([(5, 5), (3, 3)])  # prompts cover everything: no targets
    assert targets_of(empty) == 0
    calls: list[int] = []
    toy64.register_forward_hook(lambda *_: calls.append(1))
    before = params(toy64)
    optimizer = torch.optim.Adam(toy64.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 0.5**u)

    report = al.train_window(
        toy64, [empty, empty], optimizer, al.NextTokenLoss(), scheduler=scheduler
    )
    assert not report.applied
    assert report.skipped_reason == "no targets"
    assert report.targets == 0 and report.examples == 4 and report.backward_passes == 0
    assert math.isnan(report.loss)
    assert calls == []  # no forward pass at all
    assert all(torch.equal(before[n], p) for n, p in toy64.named_parameters())
    assert optimizer.state == {} and scheduler.last_epoch == 0


def test_window_with_one_empty_microbatch_still_counts_the_others(toy64: nn.Module) -> None:
    empty = token_batch([(4, 4)], seed=5)
    full = token_batch([(6, 1), (4, 0)], seed=6)
    ref = token_mean_gradient(copy.deepcopy(toy64), [full])
    optimizer = capture(toy64)
    report = al.train_window(toy64, [empty, full, empty], optimizer, al.NextTokenLoss())
    assert report.applied and report.targets == targets_of(full) and report.backward_passes == 3
    assert rel_error(ref, optimizer.seen[0]) < 1e-10


def _nan_window() -> list[dict[str, Tensor]]:
    return [xs(1.0, 2.0), xs(float("nan"))]


def test_non_finite_gradient_is_skipped_and_leaves_weights_and_state() -> None:
    model = OneWeight(1.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 0.5**u)
    objective = al.ExampleLoss(loss_is_output)
    first = al.train_window(model, [xs(1.0, 2.0)], optimizer, objective, scheduler=scheduler)
    assert first.applied and scheduler.last_epoch == 1
    w = float(model.w.detach())
    state = {k: v.clone() for k, v in optimizer.state[model.w].items()}

    report = al.train_window(
        model, _nan_window(), optimizer, objective, scheduler=scheduler, index=1
    )
    assert not report.applied and report.skipped_reason == "non-finite gradient"
    assert scheduler.last_epoch == 1  # a skipped attempt does not shift the schedule
    assert not math.isfinite(report.grad_norm)
    assert float(model.w.detach()) == w
    assert all(torch.equal(state[k], v) for k, v in optimizer.state[model.w].items())
    assert model.w.grad is None


def test_non_finite_gradient_raises_when_asked() -> None:
    model = OneWeight(1.0)
    with pytest.raises(FloatingPointError, match="non-finite gradient.*window 4"):
        al.train_window(
            model,
            _nan_window(),
            sgd(model),
            al.ExampleLoss(loss_is_output),
            nonfinite="raise",
            index=4,
        )
    assert float(model.w.detach()) == 1.0 and model.w.grad is None


def test_clip_grad_norm_clips_the_combined_gradient(gpt64: nn.Module) -> None:
    window = gpt_window(seed=7)
    ref = token_mean_gradient(copy.deepcopy(gpt64), window)
    ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref.values()])))
    max_norm = ref_norm / 4
    optimizer = capture(gpt64)
    report = al.train_window(gpt64, window, optimizer, al.NextTokenLoss(), clip_grad_norm=max_norm)
    seen = optimizer.seen[0]
    seen_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in seen.values()])))
    assert report.grad_norm == pytest.approx(ref_norm, rel=1e-9)  # norm before clipping
    assert seen_norm <= max_norm * (1 + 1e-6)
    # one scale for the whole combined gradient: the direction is the unclipped one
    assert rel_error({n: g * (max_norm / ref_norm) for n, g in ref.items()}, seen) < 1e-6


def test_clip_above_the_norm_changes_nothing(gpt64: nn.Module) -> None:
    window = gpt_window(seed=8)
    ref = token_mean_gradient(copy.deepcopy(gpt64), window)
    optimizer = capture(gpt64)
    report = al.train_window(gpt64, window, optimizer, al.NextTokenLoss(), clip_grad_norm=1e6)
    assert report.grad_norm < 1e6
    assert rel_error(ref, optimizer.seen[0]) < 1e-10


def test_meter_sees_forward_and_backward_per_microbatch_then_one_update(toy64: nn.Module) -> None:
    meter = RecordingMeter()
    window = [token_batch([(4, 0)], seed=s) for s in range(3)]
    al.train_window(toy64, window, sgd(toy64), al.NextTokenLoss(), meter=meter)
    assert meter.phases == [
        ("forward", 0),
        ("backward", 0),
        ("forward", 1),
        ("backward", 1),
        ("forward", 2),
        ("backward", 2),
        ("update", None),
    ]


def test_forward_hook_adapts_other_models() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0, 1])
    batch = {"features": x, "labels": y}
    torch.nn.functional.cross_entropy(model(x), y).backward()
    ref = grads(model)
    model.zero_grad()
    optimizer = capture(model)
    al.train_window(
        model,
        al.split_batch(batch, [2, 3]),
        optimizer,
        al.ExampleLoss(),
        forward=lambda m, b: m(b["features"]),
    )
    assert rel_error(ref, optimizer.seen[0]) < 1e-12


def test_default_forward_drops_labels_and_example_ids() -> None:
    class Strict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 3)

        def forward(self, x: Tensor) -> Tensor:  # no labels / example_ids parameters
            return self.lin(x)

    batch = {
        "x": torch.randn(4, 2),
        "labels": torch.tensor([0, 1, 2, 0]),
        "example_ids": torch.arange(4),
    }
    model = Strict()  # the optimizer must hold this model's parameters
    report = al.train_window(model, [batch], sgd(model), al.ExampleLoss())
    assert report.applied and report.examples == 4


def test_window_with_a_non_mapping_microbatch_raises(toy64: nn.Module) -> None:
    with pytest.raises(TypeError, match="microbatch 1 must be a mapping"):
        al.train_window(
            toy64, [token_batch([(3, 0)]), torch.zeros(2, 3)], sgd(toy64), al.NextTokenLoss()
        )
    with pytest.raises(ValueError, match="microbatch 0 has no 'labels'"):
        al.accumulate(
            toy64, [{"input_ids": torch.zeros(1, 3, dtype=torch.long)}], al.NextTokenLoss()
        )


def test_window_with_mismatched_shapes_raises(toy64: nn.Module) -> None:
    batch = token_batch([(5, 0), (4, 1)])
    bad = {**batch, "labels": batch["labels"][:, :3]}
    with pytest.raises(ValueError, match="do not match labels"):
        al.train_window(toy64, [bad], sgd(toy64), al.NextTokenLoss())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_grad_norm": 0.0}, "clip_grad_norm must be positive"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm must be positive"),
        ({"nonfinite": "ignore"}, "nonfinite must be"),
        ({"scheduler_per": "microbatch"}, "scheduler_per must be"),
        ({"precision": "fp8"}, "precision must be one of"),
    ],
)
def test_train_window_rejects_bad_options(toy64: nn.Module, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        al.train_window(toy64, [token_batch([(3, 0)])], sgd(toy64), al.NextTokenLoss(), **kwargs)


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("clip_grad_norm", "1"),
        ("clip_grad_norm", 0.0),
        ("clip_grad_norm", math.inf),
        ("nonfinite", "ignore"),
        ("nonfinite", None),
        ("scheduler_per", "step"),
        ("sync", 1),
        ("precision", "fp8"),
        ("precision", None),
    ],
)
def test_train_and_train_window_word_a_bad_option_the_same_way(
    toy64: nn.Module, keyword: str, value: object
) -> None:
    """Each option is checked by one helper, whether ``train`` or ``train_window`` is
    called: the same error type and the same message."""
    window = [token_batch([(3, 0)])]
    with pytest.raises((TypeError, ValueError)) as by_window:
        al.train_window(toy64, window, sgd(toy64), al.NextTokenLoss(), **{keyword: value})
    with pytest.raises((TypeError, ValueError)) as by_train:
        plan = al.AccumulationPlan(micro_batch_size=1, accumulation_steps=1)
        al.train(toy64, window, sgd(toy64), plan, al.NextTokenLoss(), **{keyword: value})
    assert type(by_train.value) is type(by_window.value)
    assert str(by_train.value) == str(by_window.value)
    assert str(by_window.value).startswith(keyword)


# ------------------------------------------------------------------------ train


def counted(batches: list[Mapping[str, Tensor]], log: list[int]) -> Iterator[Mapping[str, Tensor]]:
    """Yield ``batches``, appending each index to ``log`` as it is read."""
    for i, batch in enumerate(batches):
        log.append(i)
        yield batch


def test_train_windows_match_train_window_calls(toy64: nn.Module) -> None:
    batches = [token_batch([(5, 1), (4, 0)], seed=s) for s in range(5)]
    twin = copy.deepcopy(toy64)
    plan = al.AccumulationPlan(2, 2)
    ledger = al.train(toy64, batches, sgd(toy64, 0.3), plan, al.NextTokenLoss(), progress=False)
    optimizer = sgd(twin, 0.3)
    for window in plan.windows(batches):
        al.train_window(twin, window.microbatches, optimizer, al.NextTokenLoss())
    assert ledger.update_attempts == 3
    assert rel_error(params(twin), params(toy64)) < 1e-12


def test_train_max_updates_stops_reading(toy64: nn.Module) -> None:
    batches = [token_batch([(4, 0)], seed=s) for s in range(10)]
    read: list[int] = []
    seen: list[al.UpdateReport] = []
    ledger = al.train(
        toy64,
        counted(batches, read),
        sgd(toy64),
        al.AccumulationPlan(1, 2),
        al.NextTokenLoss(),
        max_updates=3,
        progress=False,
        on_update=seen.append,
    )
    assert ledger.update_attempts == 3 and ledger.updates_applied == 3
    assert ledger.loader_batches == 6 and ledger.microbatches == 6
    assert read == list(range(6))  # the rest of the iterable was not read
    assert seen == ledger.reports and [r.index for r in seen] == [0, 1, 2]


def test_scheduler_advances_once_per_applied_update(toy64: nn.Module) -> None:
    batches = [token_batch([(4, 0)], seed=s) for s in range(4)]
    empty = token_batch([(4, 4)])
    batches[2:4] = [empty, empty]  # window 1 (microbatches 2, 3) has no targets
    batches += [token_batch([(5, 1)], seed=9)] * 2
    optimizer = sgd(toy64, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0 / (u + 1))
    ledger = al.train(
        toy64,
        batches,
        optimizer,
        al.AccumulationPlan(1, 2),
        al.NextTokenLoss(),
        scheduler=scheduler,
        progress=False,
    )
    assert ledger.update_attempts == 3 and ledger.updates_applied == 2
    assert ledger.updates_skipped == 1
    assert [r.skipped_reason for r in ledger.reports] == [None, "no targets", None]
    assert scheduler.last_epoch == 2  # applied updates, not attempts or microbatches
    assert [r.lr for r in ledger.reports] == pytest.approx([1.0, 0.5, 0.5])


def test_scheduler_per_attempt_counts_skipped_non_finite_attempts() -> None:
    model = OneWeight(1.0)
    optimizer = sgd(model, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0 / (u + 1))
    batches = [xs(1.0), xs(float("inf")), xs(2.0)]
    ledger = al.train(
        model,
        batches,
        optimizer,
        al.AccumulationPlan(1, 1),
        al.ExampleLoss(loss_is_output),
        scheduler=scheduler,
        scheduler_per="attempt",
        progress=False,
    )
    assert [r.applied for r in ledger.reports] == [True, False, True]
    assert scheduler.last_epoch == 3
    assert [r.lr for r in ledger.reports] == pytest.approx([1.0, 0.5, 1 / 3])


def test_train_on_the_shipped_data_with_tiny_gpt() -> None:
    model = small_gpt(block_size=128)
    examples = load_examples(limit=10)
    batches = microbatches(examples, 3)  # sizes 3, 3, 3, 1
    ledger = al.train(
        model,
        batches,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        al.AccumulationPlan(3, 2),
        al.NextTokenLoss(),
        progress=False,
    )
    assert ledger.update_attempts == 2 and ledger.updates_applied == 2
    assert ledger.examples == 10
    assert ledger.targets == sum(targets_of(b) for b in batches)
    assert all(math.isfinite(r.loss) and r.loss > 0 for r in ledger.reports)
    assert math.log(VOCAB_SIZE) == pytest.approx(ledger.reports[0].loss, rel=0.1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"plan": (2, 2)}, TypeError, "plan must be an AccumulationPlan"),
        ({"max_updates": 0}, ValueError, "max_updates must be at least 1"),
        ({"max_updates": True}, TypeError, "max_updates must be an int"),
        ({"precision": "fp64"}, ValueError, "precision must be one of"),
    ],
)
def test_train_rejects_bad_arguments_before_reading_data(
    toy64: nn.Module, kwargs: dict, error: type[Exception], match: str
) -> None:
    read: list[int] = []
    arguments: dict[str, Any] = {"plan": al.AccumulationPlan(1, 2), **kwargs}
    plan = arguments.pop("plan")
    with pytest.raises(error, match=match):
        al.train(
            toy64,
            counted([token_batch([(3, 0)])], read),
            sgd(toy64),
            plan,
            al.NextTokenLoss(),
            progress=False,
            **arguments,
        )
    assert read == []


def test_labels_ignored_positions_use_objective_ignore_index(toy64: nn.Module) -> None:
    batch = token_batch([(6, 2), (4, 0)])
    relabeled = {**batch, "labels": batch["labels"].masked_fill(batch["labels"] == IGNORE, -1)}
    ref = token_mean_gradient(copy.deepcopy(toy64), [batch])
    optimizer = capture(toy64)
    al.train_window(toy64, [relabeled], optimizer, al.NextTokenLoss(ignore_index=-1))
    assert rel_error(ref, optimizer.seen[0]) < 1e-12
