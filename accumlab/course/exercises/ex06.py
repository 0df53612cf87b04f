"""Exercises for notebook 06 (where equivalence ends).

- ``sequence_weighted_window``: accumulate one window of a *sequence-weighted* objective,
  ``answer(model, window, sequence_losses) -> None``. Every sequence counts once, however
  many targets it has: the window's loss is the mean, over the window's sequences, of each
  sequence's mean next-token loss. ``window`` is a list of microbatches (dicts with
  ``input_ids`` and ``labels``, as :func:`accumlab.course.data.collate` makes them), the
  model is a :class:`~accumlab.course.models.TinyGPT` (``model(input_ids).logits``), and
  ``sequence_losses(logits, labels)`` returns one mean loss per sequence, shape (batch,).
  After the call every parameter's ``.grad`` must hold the gradient of that window loss,
  as one backward pass over all the window's sequences would give; the caller clears
  ``.grad`` before and steps after.

The checker runs the answer on fresh tiny GPTs and windows whose microbatches differ in
both sequences and targets, and names the usual mistakes: the token-weighted denominator
(right for another objective), the average or the sum of microbatch means, no division,
a second division by the number of microbatches, ``zero_grad`` inside, a step inside.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...checks import compare, gradients, split_batch
from ...objectives import NextTokenLoss
from ..data import VOCAB_SIZE, Example, collate
from ..models import TinyGPT
from . import Exercise, fills_grad_only

#: Relative tolerance of the checker: float32 accumulation order changes the last bits only.
RTOL = 1e-4

Window = Sequence[Mapping[str, Tensor]]
SequenceLosses = Callable[[Tensor, Tensor], Tensor]


def sequence_losses(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Each sequence's mean next-token loss (nats per target), shape (batch,).

    ``logits`` (batch, seq, vocab) score the token after each position; ``labels``
    (batch, seq) are unshifted, with ignored positions at ``ignore_index``. Position ``t``
    is scored against ``labels[:, t + 1]``. Every sequence needs at least one target.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (batch, seq, vocab) and labels (batch, seq); got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    targets = labels[:, 1:]
    per_token = F.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(),  # (batch, vocab, seq - 1)
        targets.to(logits.device),
        ignore_index=ignore_index,
        reduction="none",
    )
    counts = (targets != ignore_index).sum(dim=1)
    if bool((counts == 0).any()):
        raise ValueError(
            "a sequence has no supervised target, so its mean is undefined; drop it from "
            "the window or use a token-weighted objective"
        )
    return per_token.sum(dim=1) / counts.to(per_token.device)


def reference_sequence_weighted_window(
    model: nn.Module, window: Window, sequence_losses: SequenceLosses
) -> None:
    """Backpropagate (sum of the microbatch's sequence means) / (sequences in the window)."""
    total = sum(int(mb["labels"].shape[0]) for mb in window)  # sequences, not targets
    for microbatch in window:
        logits = model(microbatch["input_ids"]).logits
        loss = sequence_losses(logits, microbatch["labels"]).sum() / total
        loss.backward()  # adds into .grad; no zero_grad, no step here


def _case(seed: int, lengths: list[int]) -> tuple[nn.Module, dict[str, Tensor]]:
    """A tiny GPT and one batch of sequences of the given lengths (prompts masked)."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i, length in enumerate(lengths):
        ids = torch.randint(2, VOCAB_SIZE, (length,), generator=g).tolist()
        examples.append(Example(id=i, input_ids=ids, prompt_len=int(length // 3)))
    torch.manual_seed(seed)
    model = TinyGPT(VOCAB_SIZE, block_size=32, n_layer=1, n_head=2, n_embd=16)
    return model, collate(examples)


def _cases() -> list[tuple[list[int], list[int]]]:
    """(microbatch sizes in sequences, sequence lengths in tokens) for each case."""
    return [([1, 3], [28, 5, 7, 6]), ([2, 1, 1], [6, 25, 9, 30])]


def _flat(grads: Mapping[str, Tensor]) -> Tensor:
    return torch.cat([g.reshape(-1).double() for g in grads.values()])


def _grad_of(model: nn.Module, loss: Callable[[], Tensor]) -> Tensor:
    model.zero_grad(set_to_none=True)
    loss().backward()
    grads = _flat(gradients(model))
    model.zero_grad(set_to_none=True)
    return grads


def _sequence_sum(model: nn.Module, mb: Mapping[str, Tensor]) -> Tensor:
    return sequence_losses(model(mb["input_ids"]).logits, mb["labels"]).sum()


def _close(a: Tensor, b: Tensor) -> bool:
    scale = float(b.abs().max())
    return scale > 0 and float((a - b).abs().max()) <= RTOL * scale


def _diagnose(model: nn.Module, window: Window, got: Tensor) -> str | None:
    """Name the known mistake whose gradient ``got`` reproduces, if any."""
    sizes = [int(mb["labels"].shape[0]) for mb in window]
    total, a = sum(sizes), len(window)
    parts = [_grad_of(model, lambda mb=mb: _sequence_sum(model, mb)) for mb in window]
    tokens = NextTokenLoss()
    targets = sum(tokens.count(mb) for mb in window)
    token_mean = sum(
        _grad_of(model, lambda mb=mb: tokens.loss_sum(model(mb["input_ids"]), mb) / targets)
        for mb in window
    )
    known = [
        (token_mean, "it is the token-weighted gradient (token loss sum / the window's "
         f"{targets} targets): right for NextTokenLoss, but here every sequence counts once, "
         "so sum the sequence means and divide by the window's number of sequences"),
        (sum(p / (n * a) for p, n in zip(parts, sizes, strict=True)),
         "it is the average of the microbatch means: that gives a sequence in a small "
         f"microbatch more weight; divide each microbatch's sum by all {total} sequences"),
        (sum(p / n for p, n in zip(parts, sizes, strict=True)),
         "it is the sum of the microbatch means; divide each microbatch's sum of sequence "
         f"means by the window's {total} sequences"),
        (sum(parts), f"it is {total} times the right gradient: divide by the window's {total} "
         "sequences"),
        (sum(parts) / (total * a), f"it is 1/{a} of the right gradient: you divided twice, by "
         f"the {total} sequences and again by the {a} microbatches (the double division a "
         "framework that already normalizes causes)"),
    ]
    known += [
        (parts[-1] * scale, "only the last microbatch's gradient survived: never clear "
         "gradients inside the microbatch loop")
        for scale in (1.0 / total, 1.0 / sizes[-1], 1.0)
    ]
    for expected, message in known:
        if _close(got, expected):
            return message
    return None


def check_sequence_weighted_window(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` fills ``.grad`` with the sequence-weighted full-batch gradient
    on every case (relative error at most :data:`RTOL`), else what went wrong."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    with torch.random.fork_rng(devices=[]):  # leave the notebook's random state alone
        for seed, (sizes, lengths) in enumerate(_cases(), start=60):
            model, batch = _case(seed, lengths)
            window = split_batch(batch, sizes)
            model.zero_grad(set_to_none=True)
            reference_sequence_weighted_window(model, [batch], sequence_losses)
            reference = gradients(model)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

            model.zero_grad(set_to_none=True)
            answer(model, window, sequence_losses)
            got = gradients(model)
            where = f"on microbatches of {sizes} sequences of {lengths} tokens"
            problem = fills_grad_only(model, weights, where)
            if problem is not None:
                return problem
            comparison = compare(reference, got)
            if comparison.ok(RTOL):
                continue
            mistake = _diagnose(model, window, _flat(got))
            if mistake is not None:
                return f"{where}: {mistake}"
            return (
                f"{where}: the gradient differs from the sequence-weighted full batch "
                f"(max relative error {comparison.max_rel_error:.3g} > {RTOL:g})"
            )
    return None


sequence_weighted_window = Exercise(
    name="sequence_weighted_window",
    checker=check_sequence_weighted_window,
    hints=(
        "The unit is the sequence: the window's denominator is the number of sequences in "
        "all its microbatches (mb['labels'].shape[0] summed), known before any forward.",
        "For each microbatch: logits = model(mb['input_ids']).logits; "
        "sequence_losses(logits, mb['labels']) gives one mean per sequence; sum them.",
        "Divide that sum by the window's number of sequences, once, and call .backward(); "
        "no zero_grad and no step inside.",
    ),
    reference=inspect.getsource(reference_sequence_weighted_window),
)
