"""What a run checks at every update attempt and before its first microbatch, beyond the
arguments themselves: the optimizer's hyper-parameters as a scheduler leaves them (finite,
a learning rate of at least 0), the counts an objective gives (whole numbers of at least
0), and a scheduler whose ``step()`` needs arguments ``train`` cannot give.

Each case is one of issue 40's reproductions: a ``LambdaLR`` that turns the learning rate
NaN or inf from update 2 on used to apply it and leave non-finite weights; an objective
whose ``count()`` is negative trained nothing and the ledger said ``-433 targets``;
``ReduceLROnPlateau`` failed only after an update was applied.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from helpers.batches import token_batch
from torch import Tensor, nn

import accumlab as al

LR = 0.01


def sgd(model: nn.Module, **kwargs: Any) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR, **kwargs)


def batches(n: int = 6) -> list[dict[str, Tensor]]:
    return [token_batch([(5, 0), (4, 1)], seed=s) for s in range(n)]


def from_update_2(value: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A factor of 1 for updates 0 and 1, ``value`` from update 2 on (the scheduler has
    stepped twice then)."""
    return lambda step: 1.0 if step < 2 else value  # type: ignore[return-value]


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def weights(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------- a learning rate that turns NaN, inf or < 0


@pytest.mark.parametrize("factor", [math.nan, math.inf, -1.0])
def test_a_scheduler_that_makes_the_learning_rate_unusable_skips_those_updates(
    toy64: nn.Module, factor: float
) -> None:
    optimizer = sgd(toy64)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, from_update_2(factor))
    after: list[list[Tensor]] = []
    plan = al.AccumulationPlan(2, 1)
    ledger = al.train(
        toy64, batches(), optimizer, plan, al.NextTokenLoss(),
        scheduler=scheduler, progress=False, on_update=lambda r: after.append(weights(toy64)),
    )
    lrs = [r.lr for r in ledger.reports]
    assert lrs[:2] == [LR, LR] and all(lr != LR for lr in lrs[2:])
    assert [r.applied for r in ledger.reports] == [True, True, False, False, False, False]
    assert finite(toy64)
    for before, now in zip(after[1:], after[2:], strict=False):  # skipped: nothing moved
        assert all(torch.equal(a, b) for a, b in zip(before, now, strict=True))
    for report in ledger.reports[2:]:
        reason = report.skipped_reason or ""
        assert reason.startswith(f"unusable hyper-parameter in update {report.index}: "), reason
        assert "learning rate" in reason, reason
        assert "param_groups[0]['lr']" in reason and str(LR * factor) in reason, reason
    assert ledger.updates_skipped == 4
    record = al.RunRecord.from_run(plan, ledger)
    assert (record.skipped_hyperparameters, record.skipped_nonfinite) == (4, 0)


@pytest.mark.parametrize("factor", [math.nan, math.inf, -1.0])
def test_under_nonfinite_raise_an_unusable_learning_rate_raises_before_the_step(
    toy64: nn.Module, factor: float
) -> None:
    optimizer = sgd(toy64)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, from_update_2(factor))
    reports: list[al.UpdateReport] = []
    with pytest.raises(ValueError, match=r"update 2: .*\['lr'\].*learning rate") as caught:
        al.train(
            toy64, batches(), optimizer, al.AccumulationPlan(2, 1), al.NextTokenLoss(),
            scheduler=scheduler, progress=False, nonfinite="raise", on_update=reports.append,
        )
    assert "not applied" in str(caught.value)
    assert [r.applied for r in reports] == [True, True]
    assert finite(toy64)


@pytest.mark.parametrize(
    ("key", "value"), [("momentum", math.nan), ("weight_decay", math.inf), ("dampening", -math.inf)]
)
def test_any_hyperparameter_turned_non_finite_between_windows_skips_the_window(
    toy64: nn.Module, key: str, value: float
) -> None:
    """``train_window`` on its own: a hyper-parameter set to NaN or inf after the optimizer
    was built (as a scheduler or a user's hand would) is found at the update attempt."""
    optimizer = sgd(toy64, momentum=0.9)
    window = batches(2)
    assert al.train_window(toy64, window, optimizer, al.NextTokenLoss()).applied
    optimizer.param_groups[0][key] = value
    before = weights(toy64)
    report = al.train_window(toy64, window, optimizer, al.NextTokenLoss(), index=7)
    assert not report.applied
    assert f"param_groups[0][{key!r}]" in (report.skipped_reason or "")
    assert "update 7" in (report.skipped_reason or "")
    assert all(torch.equal(a, b) for a, b in zip(before, weights(toy64), strict=True))
    with pytest.raises(ValueError, match=rf"update 0: .*param_groups\[0\]\['{key}'\]"):
        al.train_window(toy64, window, optimizer, al.NextTokenLoss(), nonfinite="raise")


def test_a_skipped_learning_rate_leaves_the_gradscaler_as_it_was(toy64: nn.Module) -> None:
    """The gradient was not the problem: the scale neither backs off nor counts growth."""
    model = toy64.float()
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    window = batches(2)
    al.train_window(model, window, optimizer, al.NextTokenLoss(), precision="bf16", scaler=scaler)
    scale = scaler.get_scale()
    optimizer.param_groups[0]["lr"] = math.nan
    report = al.train_window(
        model, window, optimizer, al.NextTokenLoss(), precision="bf16", scaler=scaler
    )
    assert not report.applied and "learning rate" in (report.skipped_reason or "")
    assert scaler.get_scale() == scale == report.scale_before == report.scale_after
    optimizer.param_groups[0]["lr"] = LR  # the scaler still works for the next window
    assert al.train_window(
        model, window, optimizer, al.NextTokenLoss(), precision="bf16", scaler=scaler
    ).applied


# ---------------------------------------------------------------- negative counts


class Negated(al.NextTokenLoss):
    """Counts the targets of the microbatches in ``negated`` with the wrong sign."""

    def __init__(self, negated: list[dict[str, Tensor]]) -> None:
        super().__init__()
        self.negated = negated

    def count(self, batch: Mapping[str, Tensor]) -> int:
        n = super().count(batch)
        return -n if any(batch is b for b in self.negated) else n

    def __repr__(self) -> str:
        return "Negated()"


def test_an_objective_that_counts_below_zero_is_named_with_its_microbatch_and_count(
    toy64: nn.Module,
) -> None:
    data = batches(4)
    expected = -al.NextTokenLoss().count(data[1])
    before = weights(toy64)
    with pytest.raises(ValueError, match=rf"Negated\(\).*microbatch 1 .*is {expected};"):
        al.train(
            toy64, data, sgd(toy64), al.AccumulationPlan(2, 2), Negated([data[1]]),
            progress=False,
        )
    assert all(torch.equal(a, b) for a, b in zip(before, weights(toy64), strict=True))


@pytest.mark.parametrize("count", [2.0, True, torch.tensor(3)])
def test_a_count_that_is_not_a_whole_number_is_named(toy64: nn.Module, count: Any) -> None:
    class Counts(al.NextTokenLoss):
        def count(self, batch: Mapping[str, Tensor]) -> Any:
            return count

    with pytest.raises(TypeError, match=r"count\(\) of microbatch 0 .*must return an int"):
        al.accumulate(toy64, batches(1), Counts())


def test_accumulate_refuses_a_negative_count_before_any_forward(toy64: nn.Module) -> None:
    calls: list[int] = []
    toy64.register_forward_hook(lambda *_: calls.append(1))
    data = batches(2)
    with pytest.raises(ValueError, match=r"Negated\(\).*microbatch 0 .*is -\d+;"):
        al.accumulate(toy64, data, Negated([data[0]]))
    assert calls == []


# ------------------------------------------------- a scheduler train cannot step


def counted(data: list[dict[str, Tensor]], read: list[int]) -> Iterator[dict[str, Tensor]]:
    for i, batch in enumerate(data):
        read.append(i)
        yield batch


def test_reduce_lr_on_plateau_is_refused_before_the_first_microbatch(toy64: nn.Module) -> None:
    optimizer = sgd(toy64)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    read: list[int] = []
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau.*metrics.*on_update") as caught:
        al.train(
            toy64, counted(batches(), read), optimizer, al.AccumulationPlan(2, 1),
            al.NextTokenLoss(), scheduler=plateau, progress=False,
        )
    assert read == []
    assert "scheduler" in str(caught.value)


def test_the_suggested_fix_for_a_plateau_scheduler_trains(toy64: nn.Module) -> None:
    """What the message says to do works: step it from ``on_update`` with the loss."""
    optimizer = sgd(toy64)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    ledger = al.train(
        toy64, batches(), optimizer, al.AccumulationPlan(2, 1), al.NextTokenLoss(),
        progress=False, on_update=lambda report: plateau.step(report.loss),
    )
    assert ledger.updates_applied == 6 and plateau.last_epoch == 6


def test_train_window_on_its_own_refuses_such_a_scheduler_before_the_forward(
    toy64: nn.Module,
) -> None:
    optimizer = sgd(toy64)
    before = weights(toy64)

    class NeedsLoss:
        def step(self, loss: float) -> None: ...

    with pytest.raises(TypeError, match=r"NeedsLoss.*loss"):
        al.train_window(toy64, batches(2), optimizer, al.NextTokenLoss(), scheduler=NeedsLoss())
    assert all(torch.equal(a, b) for a, b in zip(before, weights(toy64), strict=True))
