"""The controlled set: windows of microbatches whose correct updates are known, the
tiny float64 causal language model the user's loop trains, and the counts of every
example (targets, label positions, attention-mask tokens, labels before the shift):
:class:`Row` and :func:`window_rows`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The controlled set: windows of microbatches, each microbatch a list of rows
# (real tokens, prompt tokens). Rows are right-padded to the longest row of their
# microbatch; prompt and padding labels are -100. A row with no prompt (prompt 0) has a
# target as its first label, which no prediction scores after the shift: every window
# holds one, so a count taken before the shift differs from the target count. Every
# microbatch has targets, target counts differ inside each window, and the candidate
# denominators (targets, positions, attention-mask tokens; per window or per microbatch;
# times 1, A or A²) differ from one another on every microbatch, so each weighting mistake
# has its own fingerprint (the counts before the shift and the mask tokens after it differ
# from the targets on some microbatch of every window). The last window is shorter and
# holds an odd number of microbatches, so a loop that pairs them drops one.
AUDIT_WINDOWS: tuple[tuple[tuple[tuple[int, int], ...], ...], ...] = (
    (((9, 3), (6, 2)), ((12, 4),), ((5, 0), (7, 3), (10, 5)), ((8, 2), (4, 3))),
    (((11, 2),), ((6, 3), (9, 0)), ((7, 4), (12, 2), (5, 2)), ((10, 6), (3, 1))),
    (((8, 0), (8, 4)), ((12, 3), (4, 1)), ((6, 2),), ((9, 2), (11, 7), (5, 1))),
    (((10, 4), (7, 3), (5, 0)), ((9, 2),), ((6, 0), (11, 4))),
)
AUDIT_VOCAB = 13
AUDIT_LR = 0.1
#: Relative tolerance of every comparison the audit makes (float64 measurements agree to
#: about 1e-12; a real mistake differs by far more than this).
AUDIT_TOLERANCE = 1e-6


@dataclass
class AuditOutput:
    """What the audit's model returns: ``logits`` (batch, seq, vocab) and, when called
    with ``labels``, ``loss`` computed the way a Hugging Face causal LM does (mean over the
    microbatch's targets, or their sum over ``num_items_in_batch`` when that is given)."""

    logits: Tensor
    loss: Tensor | None = None


class AuditLM(nn.Module):
    """A tiny causal language model (the audit runs it in float64), called like a Hugging
    Face model.

    Position ``t`` sees the tokens at positions ``<= t`` only (its own embedding and the
    mean of the prefix), so right padding never changes a real token's logits and every
    row is computed independently of the others.
    """

    def __init__(self, vocab_size: int = AUDIT_VOCAB, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
        use_cache: bool | None = None,
    ) -> AuditOutput:
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        prefix = x.cumsum(dim=1) / steps[:, None]  # mean of positions <= t: causal
        logits = self.head(torch.tanh(self.mix(torch.cat([x, prefix], dim=-1))))
        loss = None
        if labels is not None:
            flat = logits[:, :-1].reshape(-1, logits.size(-1))
            targets = labels[:, 1:].reshape(-1).to(logits.device)
            if num_items_in_batch is None:
                loss = F.cross_entropy(flat, targets, ignore_index=-100)
            else:
                loss = (
                    F.cross_entropy(flat, targets, ignore_index=-100, reduction="sum")
                    / num_items_in_batch
                )
        return AuditOutput(logits=logits, loss=loss)


def audit_windows(seed: int = 0) -> list[list[dict[str, Tensor]]]:
    """The controlled set: ``AUDIT_WINDOWS`` as microbatch dicts (``input_ids``,
    ``attention_mask``, ``labels``), token ids drawn with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    windows = []
    for spec in AUDIT_WINDOWS:
        window = []
        for rows in spec:
            width = max(n for n, _ in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for r, (n, prompt) in enumerate(rows):
                ids[r, :n] = torch.randint(1, AUDIT_VOCAB, (n,), generator=g)
                mask[r, :n] = 1
                labels[r, prompt:n] = ids[r, prompt:n]
            window.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        windows.append(window)
    return windows


# -- the examples of the controlled set and their counts -------------------------------

RowKey = tuple[int, int, int]  # (window, microbatch, row)


@dataclass(frozen=True)
class Row:
    """One example of the controlled set and its counts."""

    key: RowKey
    tokens: Tensor  # its real tokens (attention mask 1), 1-D
    targets: int  # supervised targets after the shift
    positions: int  # label positions after the shift in its padded microbatch
    mask: int  # attention-mask tokens
    labels: int = 0  # labels other than -100 before the shift (a first-label target too)
    mask_shifted: int = 0  # attention-mask tokens after the shift (one fewer per row)

    @property
    def microbatch(self) -> int:
        return self.key[1]


def window_rows(windows: Sequence[Sequence[Mapping[str, Tensor]]]) -> list[list[Row]]:
    """Every example of every window, in order (microbatch by microbatch, row by row)."""
    out = []
    for k, window in enumerate(windows):
        rows = []
        for i, mb in enumerate(window):
            width = int(mb["input_ids"].shape[1])
            for r in range(int(mb["input_ids"].shape[0])):
                n = int(mb["attention_mask"][r].sum())
                rows.append(
                    Row(
                        key=(k, i, r),
                        tokens=mb["input_ids"][r, :n].clone(),
                        targets=int((mb["labels"][r, 1:] != -100).sum()),
                        positions=width - 1,
                        mask=n,
                        labels=int((mb["labels"][r] != -100).sum()),
                        mask_shifted=max(n - 1, 0),
                    )
                )
        out.append(rows)
    return out
