"""Workers that only the tests launch (the course's own workers live in
``accumlab_course.workers``): bad input under a 2-rank group, the IDs
``DistributedSampler`` hands out, and a rank that fails on purpose.

Spawned processes import this module by name; pytest puts ``tests/`` on ``sys.path`` and
``multiprocessing``'s spawn start method passes that path on to the workers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from accumlab.distributed import check_example_ids, gather_example_ids, shard
from accumlab.driver import train
from accumlab.objectives import NextTokenLoss
from accumlab.plan import AccumulationPlan
from accumlab_course import data
from accumlab_course.workers import rank_and_world, small_model, wrap


def misuse(case: str) -> None:
    """Bad input under a 2-rank group, to see the errors: ``"plain model"`` calls
    ``train_window`` with an unwrapped model; ``"plan mismatch"`` calls ``train`` with a DDP
    model and a plan whose ``data_parallel_size`` is 1."""
    from accumlab.loop import train_window

    batches = data.microbatches(data.load_examples(limit=4), 2)
    objective = NextTokenLoss()
    if case == "plain model":
        model = small_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_window(model, batches, optimizer, objective)
    elif case == "plan mismatch":
        model = wrap(small_model(), "ddp")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, batches, optimizer, AccumulationPlan(2, 2), objective, progress=False)
    else:
        raise ValueError(f"case must be 'plain model' or 'plan mismatch', got {case!r}")


def sampler_ids(n_examples: int = 9) -> dict[str, Any]:
    """Which example IDs each rank gets from ``DistributedSampler`` (it repeats examples
    so every rank has as many) and from ``accumlab.distributed.shard`` (no repeats),
    gathered over ranks and checked against ``range(n_examples)``."""
    from torch.utils.data.distributed import DistributedSampler

    ids = list(range(n_examples))
    from_sampler = list(DistributedSampler(ids, shuffle=False))  # rank and world from the group
    from_shard = shard(ids)
    return {
        "DistributedSampler": check_example_ids(gather_example_ids(from_sampler), expected=ids),
        "shard": check_example_ids(gather_example_ids(from_shard), expected=ids),
    }


def fail_on_rank(failing_rank: int = 1) -> str:
    """Rank ``failing_rank`` warns (to its stderr) and raises ``ValueError`` at once; every
    other rank waits in a barrier its failed peer never reaches. Shows that ``launch``
    stops all workers at the first failure instead of waiting for the process-group
    timeout, and reports the failed rank's output with its traceback."""
    import warnings

    rank, _ = rank_and_world()
    if rank == failing_rank:
        warnings.warn(f"rank {rank} is about to fail", UserWarning, stacklevel=1)
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return "unreachable: the barrier needs the failed rank"
