"""Rank workers for tests/distributed/test_layer_ranks.py (spawned by ``accumlab.distributed.launch``).

Each returns plain data; the test process compares the ranks' answers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import accumlab as al


def _ledger(rank: int) -> al.Ledger:
    """A hand-built ledger whose counts differ by rank: rank r read microbatches of up to
    ``3 + 2r`` examples and trained on ``10 + r`` of them in one window."""
    report = al.UpdateReport(
        index=0,
        applied=True,
        examples=10 + rank,
        targets=20 + rank,
        global_targets=41,
        backward_passes=2,
        loss=1.0,
        loss_sum=float(20 + rank),
        grad_norm=1.0,
        data_parallel_size=2,
    )
    ledger = al.Ledger(largest_microbatch=3 + 2 * rank)
    ledger.record(report)
    return ledger


def reduced_over_world() -> dict[str, Any]:
    """``reduce_ledger`` over the world: counts summed, the largest microbatch a max."""
    summed = al.distributed.reduce_ledger(_ledger(dist.get_rank()))
    return {
        "largest_microbatch": summed.largest_microbatch,
        "examples": summed.examples,
        "targets": summed.targets,
        "update_attempts": summed.update_attempts,
    }


def record_over_own_group() -> dict[str, Any]:
    """``RunRecord.from_run(reduce_over_ranks=True, group=...)`` with each rank alone in
    its data-parallel group: nothing is summed across the world."""
    rank = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes each
    plan = al.AccumulationPlan(5, 2)
    record = al.RunRecord.from_run(plan, _ledger(rank), reduce_over_ranks=True, group=groups[rank])
    return {"examples": record.examples, "ranks": record.extra["ranks"]}


def _call_x(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(batch["x"])


def _squared_error(output: Tensor, labels: Tensor) -> Tensor:
    return ((output - labels) ** 2).sum(dim=-1)


def oversized_microbatch_on_one_rank() -> str:
    """``train`` where only rank 1's loader gives, in window 1, a microbatch larger than
    the plan's ``m``: returns the ``ValueError`` each rank gets (none would be a bug)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = [2, 2, 2, 3 if dist.get_rank() == 1 else 2]  # window 1's second microbatch
    batches = [{"x": torch.randn(n, 4), "labels": torch.randn(n, 2)} for n in sizes]
    plan = al.AccumulationPlan(2, 2, data_parallel_size=2)
    try:
        al.train(
            model,
            batches,
            optimizer,
            plan,
            al.ExampleLoss(_squared_error),
            forward=_call_x,
            progress=False,
        )
    except ValueError as exc:
        return str(exc)
    return "no error"
