"""What a loss counts and what it sums.

An objective answers two questions about a microbatch, and the loop needs both apart:
``count(batch) -> int``, the units (supervised tokens, or examples) it holds, on CPU
*before* the forward pass (so the window's denominator, summed over replicas, is known
before any gradient exists); and ``loss_sum(output, batch)``, the *sum* of per-unit
losses, a 0-d tensor. The window's loss is ``sum of loss_sum / sum of count``, a mean per
unit whatever the split; averaging per-microbatch means would weight a unit in a short
microbatch more than one in a long one (notebook 02).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

LABELS = "labels"


def upcast(t: Tensor) -> Tensor:
    """``t`` in at least float32: half and bfloat16 go up to float32, float64 stays float64."""
    return t if t.dtype == torch.float64 else t.float()


@runtime_checkable
class Objective(Protocol):
    """The two-method contract the loop relies on; ``unit`` names what ``count`` counts."""

    unit: str

    def count(self, batch: Mapping[str, Tensor]) -> int: ...

    def loss_sum(self, output: Any, batch: Mapping[str, Tensor]) -> Tensor: ...


def check_batch(batch: object, name: str = "batch") -> Mapping[str, Tensor]:
    """Return ``batch`` if it is a mapping with a tensor ``labels`` entry, else raise."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{name} must be a mapping of tensors such as {{'input_ids': ..., 'labels': ...}}, "
            f"got {type(batch).__name__}; wrap tensors in a dict"
        )
    if LABELS not in batch:
        raise ValueError(
            f"{name} has no 'labels' entry (keys: {sorted(batch)}); the objective reads its "
            "targets from batch['labels']"
        )
    if not isinstance(batch[LABELS], Tensor):
        raise TypeError(f"{name}['labels'] must be a tensor, got {type(batch[LABELS]).__name__}")
    return batch


PADDING_ID = -1  #: ``example_ids`` of a padding row (data-parallel alignment), never real


def rows(batch: Mapping[str, Any]) -> int:
    """Rows (examples) in a microbatch: the first dimension of ``labels`` (0 for a scalar)."""
    labels = batch[LABELS]
    return int(labels.shape[0]) if labels.dim() else 0


def take_rows(batch: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows ``start:stop`` of a microbatch: every tensor whose first dimension is the
    batch's row count is sliced; anything else (a scalar, a shared table) is kept."""
    n = rows(batch)
    return {
        k: v[start:stop] if isinstance(v, Tensor) and v.dim() and v.shape[0] == n else v
        for k, v in batch.items()
    }


def count_examples(batch: Mapping[str, Any]) -> int:
    """Examples in a microbatch: rows whose ``example_ids`` is not ``PADDING_ID`` (every
    row when there are no ``example_ids``)."""
    ids = batch.get("example_ids")
    if isinstance(ids, Tensor) and ids.dim() == 1:
        return int((ids != PADDING_ID).sum())
    return rows(batch)

def class_indices(labels: Tensor, name: str = "labels") -> Tensor:
    """Integer class labels as the int64 indices ``cross_entropy`` reads.

    Narrower integer dtypes (int32, int16, uint8) are widened, which loses nothing; bool
    and floating-point labels are a ``TypeError`` naming ``name`` and the fix.
    """
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(
            f"{name} must hold integer class indices (int64, or a narrower integer dtype "
            f"that is widened to int64), got dtype {labels.dtype}; convert them with "
            f"{name}.long() if they really are class indices"
        )
    return labels.long()


def logits_of(output: Any) -> Tensor:
    """The logits in a model's output: a tensor, an object with ``.logits``, or a mapping."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if not isinstance(logits, Tensor):
        raise TypeError(
            f"model output of type {type(output).__name__} is neither a tensor nor has a "
            "tensor .logits; pass forward=... to train_window to adapt your model"
        )
    return logits


class NextTokenLoss:
    """Causal language-model cross-entropy, counted per supervised target token.

    Targets are the labels shifted left by one (``labels[:, 1:]``), as in Hugging Face
    causal LMs; a position whose target equals ``ignore_index`` (padding, a masked
    prompt) is neither counted nor summed. ``count`` is ``(labels[:, 1:] != ignore_index)
    .sum()``; ``loss_sum`` is the summed cross-entropy over exactly those targets, in nats.
    """

    unit = "target"

    def __init__(self, ignore_index: int = -100) -> None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        self.ignore_index = ignore_index

    def __repr__(self) -> str:
        return f"NextTokenLoss(ignore_index={self.ignore_index})"

    def _labels(self, batch: object) -> Tensor:
        labels = check_batch(batch)[LABELS]
        if labels.dim() != 2:
            raise ValueError(
                f"NextTokenLoss needs labels of shape (batch, sequence), got {tuple(labels.shape)}"
            )
        if labels.is_floating_point():
            raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")
        return class_indices(labels)

    def count(self, batch: Mapping[str, Tensor]) -> int:
        """Supervised targets after the shift: ``(labels[:, 1:] != ignore_index).sum()``."""
        labels = self._labels(batch)
        return int((labels[:, 1:] != self.ignore_index).sum())

    def loss_sum(self, output: Any, batch: Mapping[str, Tensor]) -> Tensor:
        """Sum of token cross-entropies over the counted targets (0-d float tensor), in
        float32 for half-precision logits and float64 for float64 ones.

        The logits are read where they are: instead of slicing off the last position
        (which copies a (batch, sequence, vocab) tensor when it is flattened), the labels
        are shifted left and the last position gets ``ignore_index``. The only
        logits-sized buffer this adds is the log-softmax, in float32 or wider.
        """
        labels = self._labels(batch)
        logits = logits_of(output)
        if logits.dim() != 3 or logits.shape[:2] != labels.shape:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match labels of shape "
                f"{tuple(labels.shape)}; expected (batch, sequence, vocab) with the same "
                "batch and sequence sizes"
            )
        # targets[:, t] = labels[:, t + 1]; the last position predicts nothing.
        targets = F.pad(labels[:, 1:], (0, 1), value=self.ignore_index).to(logits.device)
        # reshape is a view of contiguous logits. nll_loss(log_softmax) is exactly
        # cross_entropy, but log_softmax takes the dtype to compute in: half logits are
        # widened by the kernel itself where the backend supports it (on the CPU as a
        # transient copy), instead of a float32 copy of the logits made up front.
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        log_probs = F.log_softmax(logits.reshape(-1, logits.size(-1)), dim=-1, dtype=wide)
        return F.nll_loss(
            log_probs, targets.reshape(-1), ignore_index=self.ignore_index, reduction="sum"
        )


PerExampleLoss = Callable[[Tensor, Tensor], Tensor]


def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    if not labels.is_floating_point():  # float labels are class probabilities
        labels = class_indices(labels)
    return F.cross_entropy(upcast(logits), labels, reduction="none")


def _mse(prediction: Tensor, target: Tensor) -> Tensor:
    if prediction.shape != target.shape:  # F.mse_loss would broadcast, e.g. (b, 1) with (b,)
        raise ValueError(
            f"ExampleLoss('mse') needs model output and labels of the same shape, got output "
            f"{tuple(prediction.shape)} and labels {tuple(target.shape)}; reshape one of them "
            "(e.g. output.squeeze(-1) or labels.unsqueeze(-1)) so they match element for element"
        )
    prediction = upcast(prediction)
    error = F.mse_loss(prediction, target.to(prediction.dtype), reduction="none")
    return error.reshape(error.size(0), -1).mean(dim=1)


_PER_EXAMPLE: dict[str, PerExampleLoss] = {"cross_entropy": _cross_entropy, "mse": _mse}


class ExampleLoss:
    """A per-example loss, counted per example: ``count`` is the batch size.

    ``loss`` is ``"cross_entropy"`` (class labels), ``"mse"`` (mean squared error per
    example, averaged over that example's features) or a callable
    ``(output, labels) -> Tensor`` of shape ``(batch,)`` giving one loss per example.
    ``loss_sum`` sums the per-example losses, so window loss / window count is the
    sample mean over every example in the window.
    """

    unit = "example"

    def __init__(self, loss: str | PerExampleLoss = "cross_entropy") -> None:
        if isinstance(loss, str):
            if loss not in _PER_EXAMPLE:
                raise ValueError(
                    f"loss must be one of {sorted(_PER_EXAMPLE)} or a callable, got {loss!r}"
                )
            self.name, self._fn = loss, _PER_EXAMPLE[loss]
        elif callable(loss):
            self.name, self._fn = getattr(loss, "__name__", "custom"), loss
        else:
            raise TypeError(f"loss must be a string or a callable, got {type(loss).__name__}")

    def __repr__(self) -> str:
        return f"ExampleLoss(loss={self.name!r})"

    def count(self, batch: Mapping[str, Tensor]) -> int:
        """Examples in the batch: ``batch['labels'].shape[0]``."""
        labels = check_batch(batch)[LABELS]
        if labels.dim() == 0:
            raise ValueError("labels must have a batch dimension, got a 0-d tensor")
        return int(labels.shape[0])

    def loss_sum(self, output: Any, batch: Mapping[str, Tensor]) -> Tensor:
        """Sum over examples of the per-example loss (0-d float tensor)."""
        labels = check_batch(batch)[LABELS]
        prediction = logits_of(output)
        if prediction.shape[0] != labels.shape[0]:
            raise ValueError(
                f"model output has {prediction.shape[0]} rows but labels have "
                f"{labels.shape[0]}; they must describe the same examples"
            )
        per_example = self._fn(prediction, labels.to(prediction.device))
        if per_example.shape != (labels.shape[0],):
            raise ValueError(
                f"the per-example loss must return shape ({labels.shape[0]},), got "
                f"{tuple(per_example.shape)}; use reduction='none'"
            )
        return per_example.sum()


def count_window(objective: Objective, window: Any) -> list[int]:
    """Per-microbatch unit counts of a window, computed on CPU before any forward pass.

    Each is a whole number of at least 0: ``TypeError`` for a count that is not an
    integer (a bool, a float, a tensor: ``int(...)`` it), ``ValueError`` for a negative
    one, each naming the objective, the microbatch (its place in the window) and the
    count."""
    counts = []
    for i, microbatch in enumerate(window):
        n = objective.count(check_batch(microbatch, f"microbatch {i}"))
        where = f"objective {objective!r}: count() of microbatch {i} of the window is {n!r}"
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{where}, a {type(n).__name__}; count(batch) must return an int")
        if n < 0:
            unit = getattr(objective, "unit", "unit")
            raise ValueError(
                f"{where}; a count is the number of {unit}s the microbatch holds, 0 or more: "
                "fix the objective's count(batch)"
            )
        counts.append(int(n))
    return counts

