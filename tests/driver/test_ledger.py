"""Ledger counts from real runs (both last-window policies) and the RunRecord renderings."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.batches import targets_of, token_batch
from helpers.models import OneWeight, loss_is_output
from torch import nn

import accumlab as al

SIZES = [2, 3, 2, 1, 2, 2, 3]  # seven microbatches of uneven sizes


def seven_microbatches() -> list[dict[str, torch.Tensor]]:
    """Seven token microbatches; the last one (3 examples) is the short last window."""
    out = []
    for i, size in enumerate(SIZES):
        rows = [(4 + (i + r) % 5, (i * r) % 3) for r in range(size)]
        out.append(token_batch(rows, seed=i))
    return out


def run(policy: str, toy: nn.Module) -> tuple[al.Ledger, list[dict[str, torch.Tensor]]]:
    batches = seven_microbatches()
    plan = al.AccumulationPlan(3, 3, last_window=policy)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(toy.parameters(), lr=0.1)
    return al.train(toy, batches, optimizer, plan, al.NextTokenLoss(), progress=False), batches


def test_short_last_window_update(toy64: nn.Module) -> None:
    ledger, batches = run("update", toy64)
    targets = [targets_of(b) for b in batches]
    assert ledger.update_attempts == 3 and ledger.updates_applied == 3
    assert ledger.updates_skipped == 0
    assert ledger.microbatches == ledger.backward_passes == ledger.loader_batches == 7
    assert ledger.examples == sum(SIZES) == 15
    assert ledger.targets == sum(targets)
    assert (ledger.dropped_windows, ledger.dropped_examples, ledger.dropped_targets) == (0, 0, 0)
    last = ledger.reports[-1]
    assert (last.backward_passes, last.examples, last.targets) == (1, 3, targets[6])
    assert [r.targets for r in ledger.reports] == [sum(targets[:3]), sum(targets[3:6]), targets[6]]
    assert [r.index for r in ledger.reports] == [0, 1, 2]


def test_short_last_window_drop(toy64: nn.Module) -> None:
    ledger, batches = run("drop", toy64)
    targets = [targets_of(b) for b in batches]
    assert ledger.update_attempts == 2 and ledger.updates_applied == 2
    assert ledger.microbatches == ledger.backward_passes == 6
    assert ledger.loader_batches == 7  # read, but not trained on
    assert ledger.examples == sum(SIZES[:6]) == 12
    assert ledger.targets == sum(targets[:6])
    assert ledger.dropped_windows == 1
    assert ledger.dropped_examples == 3 and ledger.dropped_targets == targets[6] > 0
    # every example read is either trained on or counted as dropped
    assert ledger.examples + ledger.dropped_examples == sum(SIZES)
    assert ledger.targets + ledger.dropped_targets == sum(targets)


def test_drop_does_not_touch_the_weights_for_the_short_window(toy64: nn.Module) -> None:
    import copy

    twin = copy.deepcopy(toy64)
    run("drop", toy64)
    batches = seven_microbatches()[:6]
    plan = al.AccumulationPlan(3, 3)
    al.train(
        twin,
        batches,
        torch.optim.SGD(twin.parameters(), lr=0.1),
        plan,
        al.NextTokenLoss(),
        progress=False,
    )
    assert all(
        torch.equal(a, b) for a, b in zip(toy64.parameters(), twin.parameters(), strict=True)
    )


def test_skipped_attempts_are_counted() -> None:
    model = OneWeight(1.0)
    batches = [
        {"x": torch.tensor([1.0, 2.0], dtype=torch.float64), "labels": torch.zeros(2)},
        {"x": torch.tensor([float("nan")], dtype=torch.float64), "labels": torch.zeros(1)},
        {"x": torch.tensor([3.0], dtype=torch.float64), "labels": torch.zeros(1)},
    ]
    ledger = al.train(
        model,
        batches,
        torch.optim.SGD(model.parameters(), lr=0.1),
        al.AccumulationPlan(2, 1),  # the first microbatch holds 2 examples
        al.ExampleLoss(loss_is_output),
        progress=False,
    )
    assert (ledger.update_attempts, ledger.updates_applied, ledger.updates_skipped) == (3, 2, 1)
    assert ledger.examples == 4 and ledger.microbatches == 3
    assert ledger.losses == pytest.approx([1.5, 3.0 * (1 - 0.1 * 1.5)])
    assert "3 update attempts (2 applied, 1 skipped)" in ledger.summary()


def test_record_and_record_dropped_add_up() -> None:
    ledger = al.Ledger()
    report = al.UpdateReport(
        index=0,
        applied=True,
        examples=4,
        targets=30,
        global_targets=30,
        backward_passes=2,
        loss=1.25,
        loss_sum=37.5,
        grad_norm=0.5,
    )
    ledger.record(report)
    ledger.record(
        al.UpdateReport(
            index=1,
            applied=False,
            examples=2,
            targets=0,
            global_targets=0,
            backward_passes=0,
            loss=math.nan,
            loss_sum=0.0,
            grad_norm=0.0,
            skipped_reason="no targets",
        )
    )
    ledger.record_dropped(3, 11)
    assert (ledger.microbatches, ledger.backward_passes) == (2, 2)  # none in a window without targets
    assert (ledger.update_attempts, ledger.updates_applied, ledger.updates_skipped) == (2, 1, 1)
    assert (ledger.examples, ledger.targets) == (6, 30)
    assert (ledger.dropped_windows, ledger.dropped_examples, ledger.dropped_targets) == (1, 3, 11)
    assert ledger.losses == [1.25]
    summary = ledger.summary()
    assert "6 examples, 30 targets" in summary and "dropped 3 examples / 11 targets" in summary


# ---------------------------------------------------------------------- RunRecord


def test_run_record_json_round_trip(toy64: nn.Module) -> None:
    ledger, _ = run("drop", toy64)
    plan = al.AccumulationPlan(3, 3, last_window="drop")
    record = al.RunRecord.from_run(plan, ledger, extra={"peak_bytes": 1234})
    data = json.loads(record.to_json())
    assert al.RunRecord(**data) == record
    assert data["effective_batch_size"] == 9 and data["last_window"] == "drop"
    assert data["update_attempts"] == 2 and data["dropped_examples"] == 3
    assert data["targets"] == ledger.targets and data["examples"] == 12
    assert data["unit"] == "target" and "targets in the window" in data["normalization"]
    assert data["first_loss"] == ledger.losses[0] and data["last_loss"] == ledger.losses[-1]
    assert data["extra"] == {"peak_bytes": 1234}


def test_run_record_without_applied_updates_has_null_losses() -> None:
    record = al.RunRecord.from_run(al.AccumulationPlan(2, 2), al.Ledger(), unit="example")
    data = json.loads(record.to_json())  # strict JSON: no NaN anywhere
    assert data["first_loss"] is None and data["last_loss"] is None
    assert "examples in the window" in data["normalization"]


def test_run_record_markdown_has_one_row_per_field(toy64: nn.Module) -> None:
    ledger, _ = run("update", toy64)
    record = al.RunRecord.from_run(
        al.AccumulationPlan(3, 3), ledger, precision="bf16", extra={"peak_mib": 12}
    )
    lines = record.to_markdown().splitlines()
    assert lines[:2] == ["| field | value |", "| --- | --- |"]
    table = dict(line.strip("|").split(" | ") for line in lines[2:])
    table = {k.strip(): v.strip() for k, v in table.items()}
    # one row per field, in order, with the extra entries in place of "extra"
    fields = [e for k in record.to_dict() for e in (["peak_mib"] if k == "extra" else [k])]
    assert list(table) == fields
    assert table["update_attempts"] == "3" and table["precision"] == "bf16"
    assert table["effective_batch_size"] == "9" and table["peak_mib"] == "12"
    assert table["first_loss"] == f"{record.first_loss:.4f}"


def test_run_record_rejects_bad_inputs() -> None:
    plan, ledger = al.AccumulationPlan(2, 2), al.Ledger()
    with pytest.raises(TypeError, match="plan must be an AccumulationPlan"):
        al.RunRecord.from_run({"micro_batch_size": 2}, ledger)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ledger must be a Ledger"):
        al.RunRecord.from_run(plan, {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unit must be .target. or .example."):
        al.RunRecord.from_run(plan, ledger, unit="token")
