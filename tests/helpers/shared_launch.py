"""Several rank workers in one launch: one process group for a test module's checks.

Every ``accumlab.distributed.launch`` starts a fresh interpreter per rank, and importing
torch and accumlab there costs about two CPU seconds a rank, often more than the worker
itself. A module whose tests each launch their own ranks spends most of its time starting
processes. :class:`SharedLaunch` runs a module's workers one after another in a single
launch (:func:`in_turn` is the body each rank runs) and hands each test its own worker's
per-rank results, so every test still asserts only on what its worker returned.

If the shared launch fails (a worker raised on some rank, a rank died, the deadline
passed), each worker is then launched alone when its test asks for it: every test passes
or fails on its own worker's outcome, with that launch's own error and traceback, as it
would with a launch of its own.

Only workers that succeed on every rank belong here; a test of how ``launch`` reports a
failing or dying rank needs a launch of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from accumlab import distributed as ald

#: The seed of torch's default generator in a fresh interpreter, read when a spawned rank
#: imports this module (unpickling :func:`in_turn`'s arguments), before any worker runs.
FRESH_SEED = torch.initial_seed()

Call = tuple[Callable[..., Any], tuple[Any, ...]]


def in_turn(calls: Sequence[Call]) -> list[Any]:
    """The body of each rank: ``fn(*args)`` for every call, in order; the results in order.

    Before each call torch's default generator is put back to a fresh interpreter's state,
    so a worker that draws without seeding draws what it would in a launch of its own; after
    each call a barrier, so no rank starts a worker while a peer is still in the previous
    one.
    """
    results = []
    for fn, args in calls:
        torch.manual_seed(FRESH_SEED)
        results.append(fn(*args))
        dist.barrier()
    return results


class SharedLaunch:
    """Workers of one test module, run in one launch of ``nprocs`` ranks on first use.

    ``calls`` maps a name to ``(fn, args)``; ``shared[name]`` is ``fn(*args)``'s result on
    each rank, in rank order, as ``launch(fn, nprocs, args)`` would return it. ``timeout_s``
    is the process-group timeout in seconds (``launch``'s); ``deadline_s`` bounds the wall
    time of each worker's launch, so the shared launch gets ``deadline_s`` times the number
    of workers (``None``: no bound, as ``launch``'s default).
    """

    def __init__(
        self,
        nprocs: int,
        calls: Mapping[str, Call],
        *,
        timeout_s: float = ald.DEFAULT_TIMEOUT_S,
        deadline_s: float | None,
    ) -> None:
        if not calls:
            raise ValueError("calls is empty: give each worker a name and its (fn, args)")
        self.nprocs = nprocs
        self.calls = dict(calls)
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self._results: dict[str, list[Any]] | None = None
        self._failed = False

    def _launch(
        self, fn: Callable[..., Any], args: tuple[Any, ...], deadline_s: float | None
    ) -> list[Any]:
        return ald.launch(fn, self.nprocs, args, timeout_s=self.timeout_s, deadline_s=deadline_s)

    def __getitem__(self, name: str) -> list[Any]:
        if name not in self.calls:
            raise KeyError(f"no worker named {name!r}; the workers are {sorted(self.calls)}")
        if self._results is None and not self._failed:
            try:
                shared_deadline_s = (
                    None if self.deadline_s is None else self.deadline_s * len(self.calls)
                )
                per_rank = self._launch(in_turn, (list(self.calls.values()),), shared_deadline_s)
            except Exception:
                self._failed = True  # each test now launches its own worker, alone
            else:
                self._results = {
                    key: [rank[i] for rank in per_rank] for i, key in enumerate(self.calls)
                }
        if self._results is not None:
            return self._results[name]
        fn, args = self.calls[name]
        return self._launch(fn, args, self.deadline_s)
