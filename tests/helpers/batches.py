"""Batch builders for tests: right-padded token batches, level batches for
:class:`helpers.models.LevelLM`, and the counts and slices tests take of them by hand."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .models import IGNORE, TOY_VOCAB


def level_batch(levels: Sequence[Sequence[int]], supervised: Sequence[Sequence[bool]]) -> dict:
    """A batch for :class:`LevelLM`: row ``r`` has target ``t + 1`` at level ``levels[r][t]``.

    ``supervised[r][t]`` says whether the target at ``t + 1`` counts; unsupervised ones
    get label ``-100``. Position 0's label is always ``-100`` (it is never a target).
    """
    ids = torch.tensor([list(row) + [1] for row in levels], dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    for r, row in enumerate(supervised):
        for t, on in enumerate(row):
            if on:
                labels[r, t + 1] = 0
    return {"input_ids": ids, "labels": labels}


def token_batch(
    rows: Sequence[tuple[int, int]],
    *,
    vocab: int = TOY_VOCAB,
    seed: int = 0,
    pad_to: int | None = None,
) -> dict[str, Tensor]:
    """Right-padded token batch; ``rows`` holds ``(length, prompt_len)`` per example.

    Labels copy the ids from ``prompt_len`` to ``length`` and are ``-100`` on the prompt
    and the padding, as a collate function with prompt masking produces them.
    """
    g = torch.Generator().manual_seed(seed)
    width = max(pad_to or 0, max(length for length, _ in rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (length, prompt) in enumerate(rows):
        ids[r, :length] = torch.randint(1, vocab, (length,), generator=g)
        mask[r, :length] = 1
        labels[r, prompt:length] = ids[r, prompt:length]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def targets_of(batch: Mapping[str, Tensor]) -> int:
    """Supervised targets after the shift, counted by hand."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def trim(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Cut trailing columns that are padding in every row (each microbatch padded to its
    own longest example, as a real collate does)."""
    width = int(batch["attention_mask"].sum(dim=1).max())
    return {k: v[:, : max(width, 1)] for k, v in batch.items()}


def rows(batch: Mapping[str, Tensor], start: int, stop: int) -> dict[str, Tensor]:
    """Examples ``start..stop-1`` of a batch."""
    return {k: v[start:stop] for k, v in batch.items()}


