"""The run record after an OOM shrink states the plan that ran and the shrink: a run given m=8, A=2 that shrank records m=4, A=4 from the shrink's update on."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import Tensor

import accumlab as al
from accumlab.objectives import rows
from accumlab_course.data import VOCAB_SIZE
from accumlab_course.models import TinyGPT


def token_microbatches(examples: int, m: int, seq: int = 8) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB_SIZE, (examples, seq), generator=g)
    whole = {"input_ids": ids, "labels": ids.clone(), "example_ids": torch.arange(examples)}
    return al.split_batch(whole, [m] * (examples // m))


def run_with_oom_at(update: int, m: int = 8, steps: int = 2, windows: int = 4) -> al.Ledger:
    """Train ``windows`` windows of the plan (m, steps); from update ``update`` on, a forward
    pass over more than ``m // 2`` examples raises ``torch.OutOfMemoryError`` (as a device
    whose memory filled up would), so ``on_oom="shrink"`` halves the microbatch there."""
    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE, block_size=16, n_layer=1, n_head=2, n_embd=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    done = {"updates": 0}

    def forward(model: torch.nn.Module, batch: Mapping[str, Tensor]) -> Any:
        if done["updates"] >= update and rows(batch) > m // 2:
            raise torch.OutOfMemoryError("simulated: the microbatch does not fit")
        return model(batch["input_ids"])

    def on_update(report: al.UpdateReport) -> None:
        done["updates"] += 1

    return al.train(
        model, token_microbatches(m * steps * windows, m), optimizer, al.AccumulationPlan(m, steps),
        al.NextTokenLoss(), forward=forward, on_update=on_update, on_oom="shrink", progress=False,
    )


def test_record_after_a_shrink_at_the_first_update_states_the_plan_that_ran():
    ledger = run_with_oom_at(0)
    assert len(ledger.shrinks) == 1 and ledger.microbatches == 16  # every window ran 4 × 4
    record = al.RunRecord.from_run(al.AccumulationPlan(8, 2), ledger)
    assert (record.micro_batch_size, record.accumulation_steps) == (4, 4)
    assert (record.planned_micro_batch_size, record.planned_accumulation_steps) == (8, 2)
    assert record.effective_batch_size == 16 == 4 * 4 * record.data_parallel_size
    assert record.shrinks == [
        {"update": 0, "from_micro_batch_size": 8, "from_accumulation_steps": 2,
         "to_micro_batch_size": 4, "to_accumulation_steps": 4}
    ]
    assert record.extra == {}  # each shrink is stated once, in record.shrinks
    table = record.to_markdown()
    assert table.count("new_micro_batch_size") == 0 and table.count("| shrinks |") == 1
    assert "| micro_batch_size | 4 |" in table and "| planned_micro_batch_size | 8 |" in table
    assert al.RunRecord.from_json(record.to_json()) == record


def test_record_after_a_later_shrink_says_from_which_update():
    ledger = run_with_oom_at(2)
    assert [r.backward_passes for r in ledger.reports] == [2, 2, 4, 4]
    record = al.RunRecord.from_run(al.AccumulationPlan(8, 2), ledger)
    assert (record.micro_batch_size, record.accumulation_steps) == (4, 4)  # the last updates
    assert [s["update"] for s in record.shrinks] == [2]


def test_two_shrinks_chain():
    ledger = al.Ledger(shrinks=[
        {"update": 1, "old_micro_batch_size": 8, "new_micro_batch_size": 4, "microbatches": 4},
        {"update": 3, "old_micro_batch_size": 4, "new_micro_batch_size": 2, "microbatches": 8},
    ])
    record = al.RunRecord.from_run(al.AccumulationPlan(8, 2), ledger)
    assert (record.micro_batch_size, record.accumulation_steps) == (2, 8)
    assert [(s["update"], s["from_micro_batch_size"], s["to_micro_batch_size"],
             s["to_accumulation_steps"]) for s in record.shrinks] == [(1, 8, 4, 4), (3, 4, 2, 8)]


def test_record_without_a_shrink_is_the_plan_given():
    record = al.RunRecord.from_run(al.AccumulationPlan(8, 2), al.Ledger())
    assert (record.micro_batch_size, record.accumulation_steps) == (8, 2)
    assert (record.planned_micro_batch_size, record.planned_accumulation_steps) == (8, 2)
    assert record.shrinks == []


def test_a_record_without_the_planned_sizes_is_refused_naming_them():
    """``planned_*`` are part of every record (no default standing in for them)."""
    data = al.RunRecord.from_run(al.AccumulationPlan(8, 2), al.Ledger()).to_dict()
    for name in ("planned_micro_batch_size", "planned_accumulation_steps"):
        del data[name]
    with pytest.raises(ValueError, match=r"missing fields \['planned_accumulation_steps', 'planned_micro_batch_size'\]"):
        al.RunRecord.from_json(json.dumps(data))
    with pytest.raises(TypeError, match="planned_micro_batch_size"):
        al.RunRecord(**{k: v for k, v in data.items() if k != "planned_accumulation_steps"})


@pytest.mark.parametrize(("m", "halvings", "expected"), [(8, 1, (4, 2)), (6, 2, (2, 4)), (5, 1, (3, 2))])
def test_sizes_after_halving_follow_the_halving_rule(m, halvings, expected):
    from accumlab.record import sizes_after_halving

    assert sizes_after_halving(m, halvings) == expected
