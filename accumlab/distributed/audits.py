"""Audits across ranks: who processed which example, and how often DDP synchronized.

:func:`check_example_ids` finds duplicated, omitted and unexpected example IDs over all
ranks (feed it :func:`gather_example_ids`); :class:`SyncCounter` counts a DDP model's
gradient all-reduces, so a test or a notebook can show one synchronization per window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..objectives import PADDING_ID
from ..parallel import is_distributed


class SyncCounter:
    """Counts a DDP model's gradient synchronizations with a communication hook.

    ``attach(ddp_model)`` registers a hook that all-reduces (and averages) each gradient
    bucket exactly as DDP's default does, and counts: ``calls`` (bucket all-reduces) and
    ``syncs`` (backward passes that synchronized: one per sync, however many buckets).
    Attach before the model's first forward; a DDP model takes one hook.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.syncs = 0
        self._group: Any = None

    def attach(self, model: DistributedDataParallel) -> SyncCounter:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"SyncCounter counts DistributedDataParallel's all-reduces, got "
                f"{type(model).__name__}; wrap the model in DistributedDataParallel first"
            )
        self._group = model.process_group
        model.register_comm_hook(self, SyncCounter._hook)
        return self

    @staticmethod
    def _hook(state, bucket):  # type: ignore[no-untyped-def]
        # No annotations: DDP checks them at run time and would reject the string
        # annotations that ``from __future__ import annotations`` makes of them.
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        state.calls += 1
        if bucket.is_last():
            state.syncs += 1
        return allreduce_hook(state._group, bucket)

    def reset(self) -> None:
        self.calls = 0
        self.syncs = 0


def example_ids_in(batches: Iterable[Mapping[str, Any]]) -> list[int]:
    """The example IDs of a rank's microbatches, in order, padding rows left out."""
    ids: list[int] = []
    for i, batch in enumerate(batches):
        if "example_ids" not in batch:
            raise ValueError(
                f"microbatch {i} has no 'example_ids' entry (keys: {sorted(batch)}); add one "
                "tensor of ids per row (accumlab_course.data.collate does) to check coverage"
            )
        ids.extend(int(x) for x in batch["example_ids"].reshape(-1).tolist() if x != PADDING_ID)
    return ids


def gather_example_ids(ids: Iterable[int]) -> list[list[int]]:
    """Every rank's list of example IDs, in rank order (``[ids]`` without a process group).

    Collective: every rank of the group must call it."""
    mine = [int(i) for i in ids]
    if not is_distributed():
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [list(x) for x in gathered]


@dataclass(frozen=True)
class ExampleIdCheck:
    """Coverage of the example IDs processed over all ranks.

    ``duplicates``: id -> the ranks that processed it, one entry per time (so
    ``{0: [0, 1]}`` means example 0 ran once on rank 0 and once on rank 1).
    ``omissions``: expected ids no rank processed. ``unexpected``: processed ids that
    were not expected. ``processed``: ids over all ranks, repeats included.
    """

    processed: int
    unique: int
    duplicates: dict[int, list[int]]
    omissions: list[int]
    unexpected: list[int]
    per_rank: list[int]

    @property
    def ok(self) -> bool:
        """True when every example was processed exactly once (and only expected ones)."""
        return not (self.duplicates or self.omissions or self.unexpected)

    def __str__(self) -> str:
        def some(xs: Sequence[Any]) -> str:
            return ", ".join(map(str, xs[:8])) + (" ..." if len(xs) > 8 else "")

        parts = [
            f"{self.processed} examples processed over {len(self.per_rank)} rank(s) "
            f"({self.per_rank}), {self.unique} distinct"
        ]
        if self.duplicates:
            shown = [f"{k} on ranks {v}" for k, v in list(self.duplicates.items())[:8]]
            parts.append(f"{len(self.duplicates)} duplicated: {some(shown)}")
        if self.omissions:
            parts.append(f"{len(self.omissions)} omitted: {some(self.omissions)}")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected: {some(self.unexpected)}")
        if self.ok:
            parts.append("each exactly once")
        return "; ".join(parts)


def check_example_ids(
    ids_per_rank: Sequence[Iterable[int]], expected: Iterable[int] | None = None
) -> ExampleIdCheck:
    """Find duplicates (an id processed more than once, on one rank or several) and, given
    ``expected``, omissions and unexpected ids. Pure: pass what
    :func:`gather_example_ids` returned, or any per-rank lists."""
    lists = [[int(i) for i in ids] for ids in ids_per_rank]
    where: dict[int, list[int]] = {}
    for rank, ids in enumerate(lists):
        for i in ids:
            where.setdefault(i, []).append(rank)
    counts = Counter({i: len(ranks) for i, ranks in where.items()})
    duplicates = {i: where[i] for i in sorted(where) if counts[i] > 1}
    omissions: list[int] = []
    unexpected: list[int] = []
    if expected is not None:
        wanted = {int(i) for i in expected}
        omissions = sorted(wanted - where.keys())
        unexpected = sorted(where.keys() - wanted)
    return ExampleIdCheck(
        processed=sum(len(ids) for ids in lists),
        unique=len(where),
        duplicates=duplicates,
        omissions=omissions,
        unexpected=unexpected,
        per_rank=[len(ids) for ids in lists],
    )
