"""A ledger summed over the ranks of a data-parallel run.

Every rank keeps its own :class:`~accumlab.ledger.Ledger` (its examples, targets, its
microbatches); :func:`reduce_ledger` sums them into the whole run's, and
:func:`rank_totals` adds what each rank held, for ``RunRecord.from_run(...,
reduce_over_ranks=True)``. Both are collective: every rank of the group calls them.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch
import torch.distributed as dist

from ..ledger import Ledger
from ..parallel import is_distributed, local_device
from ..validate import check_instance
from .alignment import gather_counts

#: Ledger counts that are the same on every aligned rank (a sum would multiply them by
#: the world size) and the one that is a maximum; every other ``int`` field of ``Ledger``
#: is a count that adds up over ranks.
_SAME_ON_EVERY_RANK = ("update_attempts", "updates_applied", "updates_skipped")
_LARGEST = "largest_microbatch"
#: The counts of one ``UpdateReport`` that add up over ranks.
_REPORT_COUNTS = ("examples", "targets", "backward_passes", "padding_microbatches")


def summed_counts() -> list[str]:
    """The ``Ledger`` fields that add up over ranks, in field order: every ``int`` field but
    the attempt counts (the same on every aligned rank) and ``largest_microbatch`` (a max)."""
    return [
        f.name
        for f in fields(Ledger)
        if f.type == "int" and f.name not in (*_SAME_ON_EVERY_RANK, _LARGEST)
    ]


def reduce_ledger(ledger: Ledger, group: Any = None) -> Ledger:
    """The ledger summed over the ranks of ``group``, the model's data-parallel group
    (``parallel.data_parallel_group``; ``None``: the world) (collective).

    Examples, targets, microbatches, backward passes, loader batches, padding and dropped
    counts are summed (:func:`summed_counts`); update attempts/applied/skipped are the
    same on every aligned rank and kept; ``largest_microbatch`` is the largest on any rank.
    Each report's counts and ``loss_sum`` are summed too, so its ``loss``
    becomes the window's mean over all ranks. Without a multi-rank group, returns
    ``ledger`` itself. Raises ``ValueError`` (on every rank) when the ranks made different
    numbers of update attempts (they were not aligned).
    """
    check_instance("ledger", ledger, Ledger, "a Ledger")
    if not is_distributed():
        return ledger
    rows = gather_counts([len(ledger.reports), ledger.largest_microbatch], group)
    attempts = [row[0] for row in rows]
    if len(set(attempts)) > 1:
        raise ValueError(
            f"ranks made different numbers of update attempts {attempts}; train with "
            "accumlab.train (it aligns ranks) before summing their ledgers"
        )
    names = summed_counts()
    values = [float(getattr(ledger, name)) for name in names]
    for report in ledger.reports:
        values.extend(float(getattr(report, name)) for name in _REPORT_COUNTS)
        values.append(report.loss_sum)
    summed = torch.tensor(values, dtype=torch.float64, device=local_device())
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    totals = summed.cpu().tolist()
    head, rest = totals[: len(names)], totals[len(names) :]
    width = len(_REPORT_COUNTS) + 1
    reports = []
    for k, report in enumerate(ledger.reports):
        row = rest[k * width : (k + 1) * width]
        counts = {name: int(round(v)) for name, v in zip(_REPORT_COUNTS, row, strict=False)}
        loss_sum = row[-1]
        loss = loss_sum / counts["targets"] if counts["targets"] else float("nan")
        reports.append(replace(report, loss_sum=loss_sum, loss=loss, **counts))
    return replace(
        ledger,
        reports=reports,
        shrinks=list(ledger.shrinks),
        largest_microbatch=max(row[1] for row in rows),
        **{name: int(round(v)) for name, v in zip(names, head, strict=True)},
    )


def rank_totals(ledger: Ledger, group: Any = None) -> tuple[Ledger, dict[str, Any]]:
    """``(reduce_ledger(ledger, group), per-rank fields)`` for ``RunRecord.from_run(...,
    reduce_over_ranks=True)`` (collective). The fields: ``ranks``, ``examples_per_rank``,
    ``targets_per_rank`` and ``padding_microbatches_per_rank``, in rank order."""
    rows = gather_counts([ledger.examples, ledger.targets, ledger.padding_microbatches], group)
    totals = {
        "ranks": len(rows),
        "examples_per_rank": [row[0] for row in rows],
        "targets_per_rank": [row[1] for row in rows],
        "padding_microbatches_per_rank": [row[2] for row in rows],
    }
    return reduce_ledger(ledger, group), totals
