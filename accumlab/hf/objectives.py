"""The objectives the Trainer audit knows, and each microbatch cut into its examples.

:class:`TokenLoss` is the token-mean cross-entropy a Hugging Face model means by its
``labels``: shifted for a causal language model (the logit at ``t`` scores the label at
``t + 1``), unshifted for a masked LM, a token classifier or the decoder of a
sequence-to-sequence model (T5, BART), with optional label smoothing (the Trainer's
``label_smoothing_factor``). :func:`intended_objective` picks it (or
:class:`accumlab.ExampleLoss` for one label per example) from the model and the labels;
a job whose objective is none of these is checked by split invariance instead
(:mod:`accumlab.hf.invariance`).

:func:`example_rows` cuts a collated microbatch into its examples, each as its own row:
no padding (positions whose ``attention_mask`` is 0 are dropped) and no packing (a row
whose ``position_ids`` start again (stop counting up by one) holds several examples; each
becomes its own row,
the label that crossed into the next example dropped). The reference gradient is built
from these rows, so a collator whose padding or packing changes what the model sees or
what it scores is measured, not copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..objectives import ExampleLoss, Objective, logits_of

IGNORE_INDEX = -100

#: Keys a packing or padding-free collator adds for the attention kernels; a row of its own
#: needs none of them.
PACKING_KEYS = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "seq_idx",
    "seq_lengths",
)


class TokenLoss:
    """Cross-entropy summed over the labelled tokens, counted per token.

    ``shift=True``: causal LM, targets ``labels[:, 1:]`` (the same as
    :class:`accumlab.NextTokenLoss`); ``shift=False``: every label not ``ignore_index``
    is the target of the logit at its own position (masked LM, token classification, a
    seq2seq decoder). ``label_smoothing`` is PyTorch's (and the Trainer's
    ``label_smoothing_factor``): ``(1 - ε)`` times the target's negative log-likelihood
    plus ``ε`` times the mean over the vocabulary. ``count(batch)`` is the number of
    targets, ``loss_sum(output, batch)`` their summed loss in nats (float32 or wider), so
    ``loss_sum / count`` over a window is the token mean.
    """

    def __init__(
        self, *, shift: bool, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX
    ) -> None:
        if not isinstance(shift, bool):
            raise TypeError(
                f"shift must be True (causal LM) or False (unshifted labels), got {shift!r}"
            )
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        self.shift = shift
        self.label_smoothing = float(label_smoothing)
        self.ignore_index = ignore_index
        self.unit = "target" if shift else "token"

    def __repr__(self) -> str:
        smoothing = f", label_smoothing={self.label_smoothing:g}" if self.label_smoothing else ""
        return f"TokenLoss(shift={self.shift}{smoothing})"

    def targets(self, labels: Tensor) -> Tensor:
        """The target of each position: ``labels`` moved left by one when shifted (the last
        position then targets nothing), else ``labels`` itself."""
        if labels.dim() != 2:
            raise ValueError(
                f"TokenLoss needs labels of shape (batch, sequence), got {tuple(labels.shape)}"
            )
        return F.pad(labels[:, 1:], (0, 1), value=self.ignore_index) if self.shift else labels

    def count(self, batch: Mapping[str, Any]) -> int:
        """Targets in ``batch``: labels not ``ignore_index`` (after the shift when shifted)."""
        return int((self.targets(batch["labels"]) != self.ignore_index).sum())

    def loss_sum(self, output: Any, batch: Mapping[str, Any]) -> Tensor:
        """Summed cross-entropy of the targets (0-d tensor, float32 for half logits)."""
        logits = logits_of(output)
        targets = self.targets(batch["labels"]).to(logits.device)
        if logits.shape[:2] != targets.shape:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match labels of shape "
                f"{tuple(targets.shape)}"
            )
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).to(wide),
            targets.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
            label_smoothing=self.label_smoothing,
        )


def _is_encoder_decoder(model: nn.Module) -> bool:
    return any(
        getattr(getattr(m, "config", None), "is_encoder_decoder", False)
        for m in (model, *model.children())
    )


def _class_names(model: nn.Module) -> list[str]:
    """The class names of the model and of the models it wraps (PEFT, a wrapper module)."""
    names = [type(model).__name__]
    base = getattr(model, "get_base_model", None)
    if callable(base):
        names.append(type(base()).__name__)
    names += [type(m).__name__ for m in model.children()]
    return names


def is_causal_lm(model: nn.Module) -> bool:
    """True when ``model`` is, or wraps, a Hugging Face causal language model (its class
    name, the Trainer's causal-LM mapping, or a ``loss_type`` of ``ForCausalLM``); an
    encoder-decoder model is not causal (its loss does not shift the labels)."""
    if _is_encoder_decoder(model):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    except ImportError:  # pragma: no cover - the mapping moved
        known = set()
    for name in _class_names(model):
        if name in known or name.endswith(("ForCausalLM", "LMHeadModel")):
            return True
    loss_types = [getattr(m, "loss_type", None) for m in (model, *model.children())]
    return any(isinstance(t, str) and t.startswith("ForCausalLM") for t in loss_types)


def _unshifted_kind(model: nn.Module) -> str | None:
    """``"seq2seq"``, ``"masked"``, ``"token"`` or None: a model whose labels are scored
    where they stand."""
    if _is_encoder_decoder(model):
        return "seq2seq"
    for name in _class_names(model):
        if name.endswith("ForMaskedLM"):
            return "masked"
        if name.endswith("ForTokenClassification"):
            return "token"
    return None


@dataclass
class Intended:
    """What the job means: ``objective`` (None when the audit does not know it), ``kind``
    (``causal``, ``masked``, ``token``, ``seq2seq``, ``example`` or ``unknown``) and a
    sentence for the report."""

    objective: Objective | None
    kind: str
    described: str


def intended_objective(
    model: nn.Module, batch: Mapping[str, Any], label_smoothing: float = 0.0
) -> Intended:
    """The objective the job means, from the model and its first microbatch."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    smoothing = f", label smoothing {label_smoothing:g}" if label_smoothing else ""
    if not isinstance(labels, Tensor):
        found = "no labels" if labels is None else f"labels of type {type(labels).__name__}"
        return Intended(
            None, "unknown", f"the batches carry {found}: the loss is the Trainer's own"
        )
    if labels.is_floating_point():
        return Intended(
            None, "unknown", "the labels are floating point (regression or soft targets)"
        )
    if labels.dim() == 2 and is_causal_lm(model):
        return Intended(
            TokenLoss(shift=True, label_smoothing=label_smoothing),
            "causal",
            f"token mean of cross-entropy over shifted targets (labels[:, 1:] != -100){smoothing}",
        )
    kind = _unshifted_kind(model)
    if labels.dim() == 2 and kind is not None:
        what = {
            "seq2seq": "decoder labels",
            "masked": "masked positions",
            "token": "labelled tokens",
        }[kind]
        return Intended(
            TokenLoss(shift=False, label_smoothing=label_smoothing),
            kind,
            f"token mean of cross-entropy over the {what} (labels != -100, unshifted){smoothing}",
        )
    if labels.dim() == 1 and not label_smoothing:
        return Intended(
            ExampleLoss("cross_entropy"),
            "example",
            "example mean of cross-entropy (one class label per example)",
        )
    return Intended(
        None,
        "unknown",
        (
            f"labels of shape {tuple(labels.shape)} on a {type(model).__name__}: not an "
            "objective the "
            "audit knows"
        ),
    )


def _per_token(value: Any, batch_size: int, length: int) -> bool:
    return (
        isinstance(value, Tensor)
        and value.dim() >= 2
        and tuple(value.shape[:2]) == (batch_size, length)
    )


def _segments(batch: Mapping[str, Any], b: int) -> list[Tensor]:
    """The positions of each example in row ``b``: its unpadded positions (attention mask
    1), cut where ``position_ids`` start again (any value but the previous one plus 1: a
    collator may number each example from 0 or, for RoBERTa-like models, from 2)."""
    ids = batch["input_ids"]
    length = ids.shape[1]
    mask = batch.get("attention_mask")
    keep = (
        mask[b].bool()
        if isinstance(mask, Tensor) and mask.dim() == 2
        else torch.ones(length, dtype=torch.bool)
    )
    positions = torch.arange(length)[keep.cpu()]
    pos = batch.get("position_ids")
    if not isinstance(pos, Tensor) or pos.dim() != 2 or positions.numel() == 0:
        return [positions]
    ids = pos[b, positions.to(pos.device)].tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1] + 1]
    ends = starts[1:] + [positions.numel()]
    return [positions[s:e] for s, e in zip(starts, ends, strict=True)]


def _row_labels(batch: Mapping[str, Any], b: int, where: Tensor, shift: bool) -> Tensor:
    """The labels of one example cut out at ``where``. With ``shift_labels`` (a collator
    that shifts for the model) they are put back unshifted: the example's first position
    has no label and its last position predicts nothing inside the example."""
    shifted = batch.get("shift_labels")
    if shift and isinstance(shifted, Tensor):
        return F.pad(shifted[b, where[:-1]], (1, 0), value=IGNORE_INDEX)
    return batch["labels"][b, where]


def example_rows(batch: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    """Every example of a collated microbatch as its own one-row batch (see the module
    docstring). ``kind`` is :attr:`Intended.kind` (``causal`` shifts, ``example`` keeps a
    label per row; ``seq2seq`` cuts the encoder by its mask and the decoder at its last
    label). Keys the attention kernels of packing need are dropped; other per-token
    tensors are cut like ``input_ids``, per-row tensors taken by row."""
    ids = batch["input_ids"]
    rows_n, length = ids.shape[0], ids.shape[1]
    labels = batch["labels"]
    drop = {"position_ids", "attention_mask", "labels", "shift_labels", *PACKING_KEYS}
    out: list[dict[str, Any]] = []
    for b in range(rows_n):
        for where in _segments(batch, b):
            if where.numel() == 0:
                continue
            row: dict[str, Any] = {}
            for key, value in batch.items():
                if key in drop or key.startswith("decoder_"):
                    continue
                if _per_token(value, rows_n, length):
                    row[key] = value[b, where][None]
                elif isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == rows_n:
                    row[key] = value[b : b + 1]
                else:
                    row[key] = value
            row["attention_mask"] = torch.ones(1, where.numel(), dtype=torch.long)
            if kind == "example":
                row["labels"] = labels[b : b + 1]
            elif kind == "seq2seq":
                row.update(_decoder_row(batch, b))
            else:
                row["labels"] = _row_labels(batch, b, where, kind == "causal")[None]
            out.append(row)
    return out


def _decoder_row(batch: Mapping[str, Any], b: int) -> dict[str, Tensor]:
    """The decoder side of one seq2seq example: its labels up to the last one scored, and
    the decoder inputs the collator gave cut to the same length."""
    labels = batch["labels"][b]
    scored = (labels != IGNORE_INDEX).nonzero()
    end = int(scored.max()) + 1 if scored.numel() else 1
    row = {"labels": labels[:end][None]}
    for key in ("decoder_input_ids", "decoder_attention_mask"):
        value = batch.get(key)
        if isinstance(value, Tensor):
            row[key] = value[b, :end][None]
    if "decoder_attention_mask" in row:
        row["decoder_attention_mask"] = torch.ones_like(row["decoder_attention_mask"])
    return row


def stack_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the same shapes put together into one batch (no padding is ever added):
    fewer forward passes for the same gradient."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        key = tuple(
            (k, tuple(v.shape) if isinstance(v, Tensor) else repr(v)) for k, v in row.items()
        )
        groups.setdefault(key, []).append(row)
    return [
        {
            k: torch.cat([r[k] for r in group]) if isinstance(v, Tensor) else v
            for k, v in group[0].items()
        }
        for group in groups.values()
    ]


def scored_after_padding(batch: Mapping[str, Any], shift: bool) -> int:
    """Targets the collated microbatch scores at a position the example does not have: a
    padding position (attention mask 0) whose shifted target is a real label, as left
    padding makes of each row's first token (an integer, counted before any forward)."""
    mask = batch.get("attention_mask")
    if not shift or not isinstance(mask, Tensor) or mask.dim() != 2:
        return 0
    shifted = batch.get("shift_labels")
    targets = (
        shifted
        if isinstance(shifted, Tensor)
        else F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    )
    return int(((mask == 0) & (targets != IGNORE_INDEX)).sum())


@torch.no_grad()
def attention_leak(
    model: nn.Module, batch: Mapping[str, Any], kind: str, device: torch.device
) -> float:
    """How much an example's logits in its packed row differ from its logits alone: the
    largest ``|Δ logit|`` over the examples' positions, relative to the largest logit, from
    forward passes as ``model`` runs them (in its own dtype, under the autocast Accelerate
    may have put on its ``forward``: the job's precision) and in eval mode (no dropout; the
    caller restores the mode). 0 when no row holds several examples. A model whose
    attention reads the example boundaries gives rounding (about 1e-7 in float32, 1e-3
    under bf16); one whose attention crosses them gives the difference the neighbours make."""
    if kind != "causal" or not packed_rows(batch):
        return 0.0
    model.eval()
    keep = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    packed = logits_of(
        model(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in keep.items()})
    )
    rows = example_rows(batch, kind)
    places = [
        (b, where)
        for b in range(batch["input_ids"].shape[0])
        for where in _segments(batch, b)
        if where.numel()
    ]
    worst, top = 0.0, 0.0
    for row, (b, where) in zip(rows, places, strict=True):
        inputs = {
            k: v.to(device) if isinstance(v, Tensor) else v for k, v in row.items() if k != "labels"
        }
        alone = logits_of(model(**inputs))[0].float()
        here = packed[b, where.to(packed.device)].float()
        worst = max(worst, float((here - alone).abs().max()))
        top = max(top, float(alone.abs().max()))
    return worst / top if top > 0 else 0.0


def packed_rows(batch: Mapping[str, Any]) -> int:
    """Rows of the collated microbatch that hold more than one example (``position_ids``
    starting again inside the row)."""
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or not isinstance(batch.get("position_ids"), Tensor):
        return 0
    return sum(len(_segments(batch, b)) > 1 for b in range(ids.shape[0]))


def job_targets(batch: Mapping[str, Any], shift: bool) -> int:
    """Targets the collated microbatch scores as a model given it would: labels not -100
    after the shift (``shift_labels`` when the collator supplies them)."""
    shifted = batch.get("shift_labels")
    if shift and isinstance(shifted, Tensor):
        return int((shifted != IGNORE_INDEX).sum())
    labels = batch["labels"]
    return int(((labels[:, 1:] if shift else labels) != IGNORE_INDEX).sum())


__all__ = [
    "IGNORE_INDEX",
    "Intended",
    "TokenLoss",
    "example_rows",
    "intended_objective",
    "is_causal_lm",
    "job_targets",
    "attention_leak",
    "packed_rows",
    "scored_after_padding",
    "stack_rows",
]
