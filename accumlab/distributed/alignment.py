"""Ranks with uneven data: every rank runs the same windows, padded with zero-target ones.

:func:`aligned_windows` gives every rank of the data-parallel group the same number of
update attempts and the same number of microbatches in each, filling the short side with
zero-target padding microbatches. Every rank then meets the same collectives in the same
order, and optimizer and scheduler states stay identical. :func:`check_plans_agree`
checks, before any data is read, that the ranks hold the same plan; :func:`shard` splits
a dataset over ranks without the repeats of ``DistributedSampler``.

Padding microbatches. A padding microbatch is a copy of a real microbatch of this rank
whose targets are all ignored: for an objective with an ``ignore_index`` (``NextTokenLoss``)
it keeps the shape and sets every label to ``ignore_index``; for any other objective
(``ExampleLoss``) it keeps zero rows. Either way ``objective.count`` is 0, its
``loss_sum`` is 0 *with* a graph, so its backward adds exactly zero to every gradient
while DDP/FSDP2 see the backward they expect. Its ``example_ids`` are all
``PADDING_ID`` (-1), which is how the ledger (``count_examples``) and the ID checks know
not to count it as examples; a real example must never have the id -1.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..objectives import PADDING_ID, Objective, check_batch, take_rows
from ..parallel import Replicas, is_distributed, local_device
from ..plan import AccumulationPlan, Window

T = TypeVar("T")


def check_plans_agree(plan: AccumulationPlan, group: Any = None) -> None:
    """Raise ``ValueError`` (on every rank) naming the first field in which the ranks of
    ``group`` (``None``: the world) hold different plans. Collective: one all-gather.

    Ranks with different plans would meet different collectives (different numbers of
    microbatches per window) and fail deep inside the backend, or train on different
    effective batches; checking once, before any data is read, says which field differs.
    """
    if not is_distributed():
        return
    fields = plan.to_dict()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, fields, group=group)
    for name in fields:
        values = [g[name] for g in gathered]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(
                f"the ranks' plans differ in {name} ({shown}; ranks numbered within the "
                "data-parallel group); build the same AccumulationPlan on every rank"
            )



def gather_counts(values: Sequence[int], group: Any = None) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank) in the rank order of
    ``group`` (``None``: the world): one all-reduce. ``[values]`` without a process group."""
    values = [int(v) for v in values]
    if not is_distributed():
        return [values]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros((world, len(values)), dtype=torch.int64, device=local_device())
    table[rank] = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    return table.cpu().tolist()

def check_plan(plan: AccumulationPlan, replicas: Replicas) -> None:
    """Check ``plan`` against the model's ``replicas`` (``parallel.Replicas.of(model)``)
    and against the plans of the other data-parallel ranks, before any data is read.

    ``ValueError`` for ranks whose plans differ (on every rank, naming the field), and for
    a ``plan.data_parallel_size`` that is not ``D`` (the plan's effective batch, and the
    run record, would be wrong).
    """
    if replicas.size > 1:  # first, so that every rank raises the same error
        check_plans_agree(plan, replicas.group)
    if plan.data_parallel_size != replicas.size:
        raise ValueError(
            f"plan.data_parallel_size={plan.data_parallel_size} but the model has "
            f"{replicas.size} data-parallel replica(s); build the plan with "
            f"data_parallel_size={replicas.size} (al.data_parallel_size(world_size, "
            "tensor_parallel_size=..., pipeline_parallel_size=...) for hybrid jobs)"
        )


def padding_microbatch(template: Mapping[str, Any], objective: Objective) -> dict[str, Any]:
    """A microbatch with zero targets, built from a real one of this rank (see module doc).

    With ``objective.ignore_index`` (``NextTokenLoss``): the same tensors, every label set
    to ``ignore_index``. Otherwise: every tensor cut to zero rows. ``example_ids`` are all
    ``PADDING_ID``. Raises ``ValueError`` if ``objective.count`` of the result is not 0.
    """
    batch = check_batch(template, "template")
    ignore_index = getattr(objective, "ignore_index", None)
    if isinstance(ignore_index, int):
        pad = dict(batch)
        pad["labels"] = torch.full_like(batch["labels"], ignore_index)
    else:
        pad = take_rows(batch, 0, 0)
    pad["example_ids"] = torch.full((int(pad["labels"].shape[0]),), PADDING_ID, dtype=torch.long)
    if objective.count(pad) != 0:
        raise ValueError(
            f"cannot build a zero-target microbatch for {objective!r}: its count() is "
            f"{objective.count(pad)} for a batch with every label ignored or no rows; give "
            "the objective an int ignore_index attribute, or make count() 0 for zero rows"
        )
    return pad


def is_padding(batch: Mapping[str, Any]) -> bool:
    """True for a microbatch made by :func:`padding_microbatch` (every id is PADDING_ID)."""
    ids = batch.get("example_ids")
    return isinstance(ids, Tensor) and bool((ids == PADDING_ID).all())


def trained_lengths(microbatches: int, plan: AccumulationPlan) -> list[int]:
    """Microbatches in each window one rank trains on, for ``microbatches`` in its loader:
    ``A`` for each full window, then the short last window unless ``last_window="drop"``."""
    full, rest = divmod(int(microbatches), plan.accumulation_steps)
    short = [rest] if rest and plan.last_window == "update" else []
    return [plan.accumulation_steps] * full + short


def window_lengths(microbatches_per_rank: Sequence[int], plan: AccumulationPlan) -> list[int]:
    """Microbatches in each update attempt once the ranks are aligned.

    Every rank makes ``len(result)`` update attempts (the most any rank has) and window
    ``i`` holds ``result[i]`` microbatches on every rank (the most any rank trains on in
    window ``i``); a rank with fewer fills up with zero-target padding microbatches.
    """
    per_rank = [trained_lengths(n, plan) for n in microbatches_per_rank]
    attempts = max((len(lengths) for lengths in per_rank), default=0)
    return [
        max(lengths[i] if i < len(lengths) else 0 for lengths in per_rank) for i in range(attempts)
    ]


@dataclass(frozen=True)
class AlignedWindow:
    """One window of this rank, aligned with its peers.

    ``microbatches``: what to train on, this rank's real microbatches followed by
    ``padding`` zero-target ones; the same length on every rank. Empty when no rank
    trains in this window (only a short last window under ``last_window="drop"``).
    ``loader_batches``: microbatches read from this rank's loader for it. ``dropped``:
    real microbatches read but not trained on (a short last window under ``"drop"``).
    ``index``: position in the sequence of windows, from 0.
    """

    microbatches: list[Any]
    index: int
    loader_batches: int
    padding: int = 0
    dropped: list[Any] = field(default_factory=list)


def _split(window: Window | None, plan: AccumulationPlan) -> tuple[list[Any], list[Any]]:
    """(trained, dropped) microbatches of one loader window."""
    if window is None:
        return [], []
    if not window.complete and plan.last_window == "drop":
        return [], list(window)
    return list(window), []


def _padded(
    window: Window | None,
    trained: list[Any],
    dropped: list[Any],
    pad: dict[str, Any],
    target: int,
    index: int,
) -> AlignedWindow:
    """This rank's trained microbatches followed by padding up to ``target`` microbatches."""
    padding = target - len(trained)
    loader_batches = len(window) if window is not None else 0
    return AlignedWindow(trained + [pad] * padding, index, loader_batches, padding, dropped)


def _no_data_error(microbatches_per_rank: Sequence[int]) -> ValueError:
    empty = [r for r, n in enumerate(microbatches_per_rank) if n == 0]
    return ValueError(
        f"rank(s) {empty} have no microbatches at all; every rank needs at least one (a "
        "padding microbatch is built from the rank's own data). Give each rank a shard, "
        "e.g. accumlab.distributed.shard(examples)"
    )


def aligned_windows(
    plan: AccumulationPlan, batches: Iterable[Any], objective: Objective, group: Any = None
) -> Iterator[AlignedWindow]:
    """This rank's windows, padded so that every rank runs the same number of update
    attempts with the same number of microbatches in each.

    Outside a multi-rank process group this is ``plan.windows(batches)`` with the
    ``last_window`` policy applied. Inside one, when ``len(batches)`` exists the ranks
    exchange their microbatch counts once (one small all-reduce) and each derives every
    window's length from :func:`window_lengths`; for an iterable without ``len`` they
    agree window by window (one small all-reduce per window). A rank with fewer
    microbatches in a window, or with no window left, trains on zero-target padding
    microbatches (:func:`padding_microbatch`): they add nothing to the gradient or to the
    global target count, and make every rank synchronize at the same microbatch index.
    Raises ``RuntimeError`` if ``batches`` yields a different number of microbatches than
    its ``len``, and ``ValueError`` (on every rank) if a rank has no microbatch at all.
    The ranks that align are those of ``group``, the model's data-parallel group
    (``parallel.Replicas.group``; ``None``: the world).
    """
    windows = plan.windows(batches)
    if not is_distributed():
        for window in windows:
            trained, dropped = _split(window, plan)
            yield AlignedWindow(trained, window.index, len(window), 0, dropped)
        return
    try:
        local = len(batches)  # type: ignore[arg-type]
    except TypeError:
        yield from _aligned_lazily(plan, windows, objective, group)
        return
    yield from _aligned_by_length(plan, windows, objective, int(local), group)


def _aligned_by_length(
    plan: AccumulationPlan, windows: Iterator[Window], objective: Objective, local: int, group: Any
) -> Iterator[AlignedWindow]:
    counts = [row[0] for row in gather_counts([local], group=group)]
    if min(counts) == 0:
        raise _no_data_error(counts)
    lengths = window_lengths(counts, plan)
    pad: dict[str, Any] | None = None
    read = 0
    index = 0
    for index, target in enumerate(lengths):
        window = next(windows, None)
        trained, dropped = _split(window, plan)
        read += len(window) if window is not None else 0
        if window is None and read < local:
            raise RuntimeError(_length_lied(local, read))
        if pad is None:  # window 0 always has data on every rank
            pad = padding_microbatch((trained or dropped)[0], objective)
        yield _padded(window, trained, dropped, pad, target, index)
    for window in windows:  # only a short window dropped on every rank can be left
        trained, dropped = _split(window, plan)
        read += len(window)
        if trained:
            raise RuntimeError(_length_lied(local, read))
        yield AlignedWindow([], window.index, len(window), 0, dropped)
    if read != local:
        raise RuntimeError(_length_lied(local, read))


def _length_lied(local: int, read: int) -> str:
    return (
        f"the microbatch iterable has len() {local} but yielded {'only' if read < local else 'at least'} {read} "
        "microbatches; the ranks planned their windows from len(), so it must be exact "
        "(or pass an iterable without __len__ to align window by window)"
    )


def _aligned_lazily(
    plan: AccumulationPlan, windows: Iterator[Window], objective: Objective, group: Any
) -> Iterator[AlignedWindow]:
    pad: dict[str, Any] | None = None
    template: Any = None
    index = 0
    while True:
        window = next(windows, None)
        trained, dropped = _split(window, plan)
        if template is None and window is not None:
            template = window[0]
        rows = gather_counts([len(trained), int(template is not None)], group=group)
        target = max(row[0] for row in rows)
        if target == 0:  # no rank trains any more; report a dropped short window, if any
            if window is not None:
                yield AlignedWindow([], index, len(window), 0, dropped)
            return
        if min(row[1] for row in rows) == 0:
            raise _no_data_error([row[1] for row in rows])
        if pad is None:
            pad = padding_microbatch(template, objective)
        yield _padded(window, trained, dropped, pad, target, index)
        index += 1


def shard(items: Sequence[T], rank: int | None = None, world_size: int | None = None) -> list[T]:
    """Every ``world_size``-th item starting at ``rank``: each item on exactly one rank.

    Unlike ``DistributedSampler`` (which repeats items so every rank gets the same number),
    nothing is repeated or dropped; ranks differ by at most one item, and
    :func:`aligned_windows` absorbs the difference. ``rank``/``world_size`` default to the
    process group's (0 and 1 without one).
    """
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return list(items[rank::world_size])
