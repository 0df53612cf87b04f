"""The examples of collated microbatches, cut apart and joined: the splits of one window.

A collated microbatch is a mapping of tensors whose leading dimension runs over its
examples, ``m`` rows; a preference batch may stack several blocks of one row per example
(its chosen rows, then its rejected rows: ``k · m`` rows), which are cut alike, and a
list of ``m`` values (the texts a preference collator keeps) is cut like a row. Values
that are not per-example (a count, a flag) are kept as they are. These differ from
:mod:`accumlab.invariance.batches` (the engine's, for a loader's batches) where a
Trainer's batches need it: the stacked blocks, the lists, the tokenizer's padding id.
These functions never
pad on the left and never join packed rows (their attention kernels' keys describe the
row as collated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .objectives import IGNORE_INDEX, PACKING_KEYS


def rows_of(batch: Mapping[str, Any], examples: int | None = None) -> int:
    """Examples in a collated microbatch: ``examples`` (the configured microbatch size)
    when every tensor's leading size is a multiple of it (a preference batch stacks its
    chosen and rejected rows: 2m), else the smallest leading size its tensors have."""
    sizes = [v.shape[0] for v in batch.values() if isinstance(v, Tensor) and v.dim() >= 1]
    if not sizes:
        return 0
    if examples and all(n % examples == 0 for n in sizes):
        return examples
    return min(sizes)


def blocks(v: Tensor, examples: int) -> int:
    """How many blocks of one row per example ``v`` holds (0: not a per-example tensor)."""
    if v.dim() == 0 or examples <= 0 or v.shape[0] < examples or v.shape[0] % examples:
        return 0
    return v.shape[0] // examples


def slice_rows(batch: Mapping[str, Any], start: int, stop: int, examples: int) -> dict[str, Any]:
    """Examples ``start:stop`` of a collated microbatch of ``examples`` examples: each
    block of a per-example tensor sliced alike; anything else is kept."""
    out: dict[str, Any] = {}
    for key, v in batch.items():
        if isinstance(v, list) and len(v) == examples:
            out[key] = v[start:stop]
            continue
        k = blocks(v, examples) if isinstance(v, Tensor) else 0
        if k:
            parts = [v[j * examples + start : j * examples + stop] for j in range(k)]
            out[key] = torch.cat(parts).clone() if k > 1 else parts[0].clone()
        else:
            out[key] = v
    return out


def pad_value(key: str, pad_id: int) -> int:
    """What right padding holds under ``key``: -100 for labels, 0 for masks and positions,
    ``pad_id`` for ids."""
    if "label" in key:
        return IGNORE_INDEX
    if "mask" in key or "position" in key:
        return 0
    return pad_id


def left_padded(batch: Mapping[str, Any]) -> bool:
    """True when some attention mask has a 0 before a 1 (padding on the left)."""
    for k, v in batch.items():
        if "attention_mask" in k and isinstance(v, Tensor) and v.dim() == 2 and v.shape[1] > 1:
            if bool(((v[:, :-1] == 0) & (v[:, 1:] == 1)).any()):
                return True
    return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and bool(a == b)


def join_rows(
    batches: Sequence[Mapping[str, Any]], examples: Sequence[int], pad_id: int = 0, pad: bool = True
) -> dict[str, Any] | None:
    """The microbatches as one (``examples[i]`` examples in ``batches[i]``): each block of
    a per-example tensor concatenated block by block, right-padded to the widest (see
    :func:`pad_value`; no padding at all when ``pad`` is False); None when they cannot be
    joined that way (left padding, packing kernels' keys, keys or other values that
    differ, widths that differ where ``pad`` is False)."""
    first = batches[0]
    if any(k in first for k in PACKING_KEYS) or any(left_padded(b) for b in batches):
        return None
    if any(b.keys() != first.keys() for b in batches):
        return None
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [b[key] for b in batches]
        if all(isinstance(v, list) and len(v) == n for v, n in zip(values, examples, strict=True)):
            out[key] = [x for v in values for x in v]
            continue
        if not isinstance(value, Tensor) or value.dim() == 0:
            if not all(_same(v, value) for v in values[1:]):
                return None
            out[key] = value
            continue
        if not all(isinstance(v, Tensor) for v in values):
            return None
        ks = {blocks(v, n) for v, n in zip(values, examples, strict=True)}
        if len(ks) != 1 or not (k := ks.pop()):
            return None
        if any(v.dim() != value.dim() or v.shape[2:] != value.shape[2:] for v in values):
            return None
        width = max(v.shape[1] for v in values) if value.dim() >= 2 else None
        if width is not None and not pad and any(v.shape[1] != width for v in values):
            return None
        padded = [
            v
            if width is None or v.shape[1] == width
            else F.pad(
                v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]), value=pad_value(key, pad_id)
            )
            for v in values
        ]
        out[key] = torch.cat(
            [
                v[j * n : (j + 1) * n]
                for j in range(k)
                for v, n in zip(padded, examples, strict=True)
            ]
        )
    return out


def finer(
    batches: Sequence[Mapping[str, Any]], examples: Sequence[int]
) -> tuple[int, list[dict[str, Any]]] | None:
    """The window split finer: ``(m/2, 2A)`` when every microbatch holds the same even
    ``m``, else ``(1, n)`` (each example alone); None when every microbatch holds one."""
    if all(n <= 1 for n in examples):
        return None
    size = examples[0] // 2 if len(set(examples)) == 1 and examples[0] % 2 == 0 else 1
    return size, [
        slice_rows(b, s, s + size, n)
        for b, n in zip(batches, examples, strict=True)
        for s in range(0, n, size)
    ]


__all__ = ["blocks", "finer", "join_rows", "left_padded", "pad_value", "rows_of", "slice_rows"]
