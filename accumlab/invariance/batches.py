"""Collated microbatches cut into rows and joined again: the examples of an adapter that
sees only what a data loader collated (Lightning's ``training_step`` batches, a Trainer's
inputs).

A batch is a tensor, a mapping of them, or a tuple or list of them (nested too); its rows
are the leading dimension its per-example tensors share. :func:`take_rows` slices rows out
(anything else, a scalar or a shared table, is kept); :func:`join_rows` puts rows of
several batches together, right-padding a tensor of two or more dimensions to the widest
along dimension 1: entries named like labels with -100 (ignored by the loss), everything
else (ids, masks, positions) with 0 (masked out). Padding that a causal model cannot tell
from no padding is exactly that: right padding, masked, with ignored labels. What cannot be
joined that way raises :class:`CannotJoin` with the reason: left padding (an attention
mask with a 0 before a 1) or unnamed tensors (a tuple) of different widths, and values
other than rows that differ between the batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

#: The labels' pad value: what a cross-entropy ignores.
IGNORE_INDEX = -100


class CannotJoin(ValueError):
    """The batches' rows cannot be joined into one batch without changing what a model
    computes on them; the message says why."""


def _tensors(batch: Any) -> list[tuple[str, Tensor]]:
    if isinstance(batch, Tensor):
        return [("", batch)]
    if isinstance(batch, Mapping):
        return [(f"{k}.{n}" if n else str(k), t) for k, v in batch.items() for n, t in _tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [(n, t) for v in batch for n, t in _tensors(v)]
    return []


def rows_in(batch: Any) -> int:
    """The batch's rows: the leading size of its ``labels`` (or ``input_ids``) where it has
    them, else the leading size most of its tensors share (0 without any)."""
    if isinstance(batch, Mapping):
        for key in ("labels", "input_ids"):
            value = batch.get(key)
            if isinstance(value, Tensor) and value.dim() >= 1:
                return int(value.shape[0])
    sizes = [int(t.shape[0]) for _, t in _tensors(batch) if t.dim() >= 1]
    return max(set(sizes), key=sizes.count) if sizes else 0


def _take(value: Any, start: int, stop: int, rows: int) -> Any:
    if isinstance(value, Tensor):
        return value[start:stop] if value.dim() >= 1 and value.shape[0] == rows else value
    if isinstance(value, Mapping):
        return {k: _take(v, start, stop, rows) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_take(v, start, stop, rows) for v in value)
    return value


def take_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of ``batch``: every tensor whose leading size is the batch's row
    count is sliced (a view), everything else kept."""
    return _take(batch, start, stop, rows_in(batch))


def _left_padded(batch: Any) -> bool:
    for name, t in _tensors(batch):
        if "attention_mask" in name and t.dim() == 2 and t.shape[1] > 1:
            if bool(((t[:, :-1] == 0) & (t[:, 1:] == 1)).any()):
                return True
    return False


def _pad_value(name: str) -> int:
    return IGNORE_INDEX if "label" in name else 0


def _join(values: Sequence[Any], rows: Sequence[int], name: str, named: bool) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        if not all(isinstance(v, Tensor) for v in values):
            raise CannotJoin(f"{name or 'a value'} is a tensor in some batches only")
        per_row = [v.dim() >= 1 and v.shape[0] == n for v, n in zip(values, rows, strict=True)]
        if not any(per_row):
            if not all(v.shape == first.shape and torch.equal(v, first) for v in values):
                raise CannotJoin(f"{name or 'a tensor'} is no per-row tensor and differs between the batches")
            return first
        if not all(per_row) or len({v.dim() for v in values}) != 1:
            raise CannotJoin(f"{name or 'a tensor'} has rows in some batches only")
        if first.dim() >= 2:
            width = max(v.shape[1] for v in values)
            if any(v.shape[1] != width for v in values):
                if not named:
                    raise CannotJoin("unnamed tensors (a tuple batch) of different widths cannot be "
                                     "padded: which value a pad takes depends on what they hold")
                values = [F.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]),
                                value=_pad_value(name)) for v in values]
            if len({v.shape[2:] for v in values}) != 1:
                raise CannotJoin(f"{name} has different trailing shapes in the batches")
        return torch.cat(list(values))
    if isinstance(first, Mapping):
        if any(not isinstance(v, Mapping) or v.keys() != first.keys() for v in values):
            raise CannotJoin("the batches have different keys")
        return {k: _join([v[k] for v in values], rows, f"{name}.{k}" if name else str(k), True)
                for k in first}
    if isinstance(first, (tuple, list)):
        if any(type(v) is not type(first) or len(v) != len(first) for v in values):
            raise CannotJoin("the batches have different structures")
        return type(first)(_join([v[i] for v in values], rows, name, named) for i in range(len(first)))
    if any(v != first for v in values):
        raise CannotJoin(f"{name or 'a value'} differs between the batches ({first!r}, ...)")
    return first


def join_rows(batches: Sequence[Any]) -> Any:
    """The rows of ``batches``, in order, as one batch (see the module docstring)."""
    batches = list(batches)
    if not batches:
        raise ValueError("join_rows needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    widths = {t.shape[1] for b in batches for _, t in _tensors(b) if t.dim() >= 2}
    if len(widths) > 1 and any(_left_padded(b) for b in batches):
        raise CannotJoin("left-padded rows of different widths cannot be joined: the padding would "
                         "move their tokens' positions")
    return _join(batches, [rows_in(b) for b in batches], "", isinstance(batches[0], Mapping))


__all__ = ["IGNORE_INDEX", "CannotJoin", "join_rows", "rows_in", "take_rows"]
