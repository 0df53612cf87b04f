"""Data parallelism around the core loop, one idea per module.

- :mod:`accumlab.distributed.launch`: run a function in N local processes joined in one
  process group (spawn, free port, per-rank logs, tracebacks), or join ``torchrun``'s.
- :mod:`accumlab.distributed.alignment`: every rank runs the same windows, padded with
  zero-target microbatches, with the same plan.
- :mod:`accumlab.distributed.audits`: example-ID coverage across ranks, DDP sync counting.
- :mod:`accumlab.distributed.totals`: a ledger summed over the ranks.

The core's own data-parallel pieces (``D``, the global count, ``no_sync``) live in
:mod:`accumlab.parallel`.
"""

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
from .totals import rank_totals, reduce_ledger, summed_counts

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AlignedWindow",
    "ExampleIdCheck",
    "SyncCounter",
    "WorkerTraceback",
    "aligned_windows",
    "check_example_ids",
    "check_plan",
    "check_plans_agree",
    "default_backend",
    "example_ids_in",
    "free_port",
    "gather_counts",
    "gather_example_ids",
    "init_from_env",
    "is_padding",
    "launch",
    "padding_microbatch",
    "rank_totals",
    "reduce_ledger",
    "shard",
    "summed_counts",
    "trained_lengths",
    "window_lengths",
]

