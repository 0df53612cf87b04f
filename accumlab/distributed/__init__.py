"""Data parallelism around the core loop, one idea per module.

- :mod:`accumlab.distributed.launch`: run a function in N local processes joined in one
  process group (spawn, free port, per-rank logs, tracebacks), or join ``torchrun``'s.
- :mod:`accumlab.distributed.alignment`: every rank runs the same windows, padded with
  zero-target microbatches, with the same plan.
- :mod:`accumlab.distributed.audits`: example-ID coverage across ranks, DDP sync counting.

The core's own data-parallel pieces (``D``, the global count, ``no_sync``) live in
:mod:`accumlab.parallel`, and summing a ledger over ranks in :mod:`accumlab.ledger`;
they are re-exported here so that ``accumlab.distributed.X`` keeps working.
"""

from ..objectives import PADDING_ID, count_examples
from ..parallel import (
    any_rank,
    check_replicas,
    data_parallel_group,
    global_count,
    gradient_sync,
    is_distributed,
    local_device,
    replicas_of,
    unwrap,
)
from .alignment import (
    AlignedWindow,
    aligned_windows,
    check_plan,
    check_plans_agree,
    gather_counts,
    is_padding,
    padding_microbatch,
    shard,
    trained_lengths,
    window_lengths,
)
from .audits import (
    ExampleIdCheck,
    SyncCounter,
    check_example_ids,
    example_ids_in,
    gather_example_ids,
)
from .launch import (
    DEFAULT_TIMEOUT_S,
    WorkerTraceback,
    default_backend,
    free_port,
    init_from_env,
    launch,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PADDING_ID",
    "AlignedWindow",
    "ExampleIdCheck",
    "SyncCounter",
    "WorkerTraceback",
    "aligned_windows",
    "any_rank",
    "check_example_ids",
    "check_plan",
    "check_plans_agree",
    "check_replicas",
    "count_examples",
    "data_parallel_group",
    "default_backend",
    "example_ids_in",
    "free_port",
    "gather_counts",
    "gather_example_ids",
    "global_count",
    "gradient_sync",
    "init_from_env",
    "is_distributed",
    "is_padding",
    "launch",
    "local_device",
    "padding_microbatch",
    "rank_totals",
    "reduce_ledger",
    "replicas_of",
    "shard",
    "trained_lengths",
    "unwrap",
    "window_lengths",
]


def __getattr__(name: str) -> object:
    # Summing a ledger over ranks lives in accumlab.ledger, which imports this package;
    # importing it lazily keeps the old names without an import cycle.
    if name in ("reduce_ledger", "rank_totals"):
        from .. import ledger

        return getattr(ledger, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
