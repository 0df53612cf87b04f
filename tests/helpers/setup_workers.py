"""Test-only workers for ``tests/distributed/test_group_lookups.py``: what a run derives and
checks, counted call by call (imported by spawned ranks, as ``rank_workers`` is).

A profile function (``sys.setprofile``) counts every Python call of the watched functions
by their code objects, so a call counts however the caller imported the function (by
name, through its module, as a method). Every worker returns plain data.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import accumlab as al
from accumlab import loop, parallel, precision, validate

from .rank_workers import call_x, mlp, regression_batches, squared_error


def _watched() -> dict[CodeType, str]:
    """The code objects of what a run derives (the data-parallel group, the replicas, the
    precision policy, the scaler, the parameters an update steps) and of the checks of
    its settings, by name; a name this version does not define is left out."""
    functions: dict[str, Callable[..., Any] | None] = {
        "data_parallel_group": parallel.data_parallel_group,
        "Replicas.of": getattr(getattr(parallel, "Replicas", None), "of", None),
        "precision_policy": precision.precision_policy,
        "resolve_scaler": precision.resolve_scaler,
        "update_parameters": precision.update_parameters,
        "check_choice": validate.check_choice,
        "check_positive_number": validate.check_positive_number,
        "check_clip_grad_norm": loop.check_clip_grad_norm,
    }
    return {
        getattr(fn, "__func__", fn).__code__: name for name, fn in functions.items() if fn
    }


@contextmanager
def counted_calls() -> Iterator[Counter[str]]:
    """Count the calls of the watched functions on this thread while the block runs."""
    watched, counts = _watched(), Counter[str]()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in watched:
            counts[watched[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)


def derivations_per_window(windows: int, on_oom: list[str]) -> list[dict[str, Any]]:
    """For each ``on_oom``: train a DDP MLP with ``train`` for ``windows`` windows (A = 2
    microbatches of 2 examples on each rank), counting the calls of the watched functions
    from the start of the run to the end of each window (``on_update``). Returns one row
    per run: ``on_oom``, the counts after each window, the update attempts and a checksum
    of the weights (equal on every rank)."""
    rows = []
    for mode in on_oom:
        model = DistributedDataParallel(mlp())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        plan = al.AccumulationPlan(2, 2, data_parallel_size=dist.get_world_size())
        batches = regression_batches(2 * windows, 2, seed=dist.get_rank())
        after: list[dict[str, int]] = []
        with counted_calls() as counts:
            ledger = al.train(
                model, batches, optimizer, plan, al.ExampleLoss(squared_error),
                forward=call_x, progress=False, on_oom=mode,  # type: ignore[arg-type]
                on_update=lambda report, counts=counts, after=after: after.append(dict(counts)),
            )
        rows.append(
            {
                "on_oom": mode,
                "after_each_window": after,
                "whole_run": dict(counts),
                "attempts": ledger.update_attempts,
                "weights": float(sum(p.detach().double().sum() for p in model.parameters())),
            }
        )
    return rows
