"""Exercises for notebook 06 (where equivalence ends).

- ``sequence_weighted_window``: accumulate one window of a *sequence-weighted* objective,
  ``answer(model, window, sequence_losses) -> None``. Every sequence counts once, however
  many targets it has: the window's loss is the mean, over the window's sequences, of each
  sequence's mean next-token loss. ``window`` is a list of microbatches (dicts with
  ``input_ids`` and ``labels``, as :func:`accumlab_course.data.collate` makes them), the
  model is a :class:`~accumlab_course.models.TinyGPT` (``model(input_ids).logits``), and
  ``sequence_losses(logits, labels)`` returns one mean loss per sequence, shape (batch,).
  After the call every parameter's ``.grad`` must hold the gradient of that window loss,
  as one backward pass over all the window's sequences would give; the caller clears
  ``.grad`` before and steps after.

The checker runs the answer on fresh tiny GPTs and windows whose microbatches differ in
both sequences and targets, and names the usual mistakes: the token-weighted denominator
(right for another objective), the average or the sum of microbatch means, no division,
a second division by the number of microbatches, ``zero_grad`` inside, a step inside.

- ``contrastive_window`` (transfer): ``answer(model, window, loss_fn) -> None`` for a loss
  with in-batch negatives (:func:`info_nce`), where one pair's loss depends on every other
  pair of its pass, so accumulating it per microbatch is a different loss. ``window`` is a
  list of dicts with ``queries`` and ``keys`` (float tensors ``(rows, 6)``), ``model(x)``
  returns embeddings ``(rows, 8)``. After the call ``.grad`` holds the gradient of
  ``loss_fn`` over the whole window, while the model ran with autograd on at most one
  microbatch at a time (embed everything without gradients, backpropagate the loss to the
  embeddings, then recompute each microbatch and push those gradients in). The checker
  names the per-microbatch loss (average, sum or weighted), the whole window in one
  pass, a step inside and an empty ``.grad``.

:func:`held_out_run` is section 4's training run, measured on the examples axis.

Two predict-first questions, answered with a number before the cell that shows it:
``batchnorm_passes`` (``num_batches_tracked`` after 10 updates at ``m = 8 × A = 8``: one per
forward pass) and ``examples_at_16_updates`` (the examples an ``A = 1`` run at ``m = 8`` has
seen at its update 16, where the ``A = 4`` runs end).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from accumlab.checks import compare, gradients, split_batch
from accumlab.driver import train
from accumlab.ledger import Ledger
from accumlab.objectives import NextTokenLoss
from accumlab.plan import AccumulationPlan

from ..data import VOCAB_SIZE, Example, collate, microbatches
from ..models import TinyGPT
from ..plots import RunCurve, run_curve
from . import Exercise, fills_grad_only
from .predictions import number_prediction

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


# ---------------------------------------------------------------- predict first


def _number(answer: Any) -> float | str:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"expected a number (an int or a float), got {type(answer).__name__}"
    return float(answer)


def check_batchnorm_passes(answer: Any) -> str | None:
    """None when the prediction is 80: BatchNorm counts 8 forward passes per window for 10
    updates at ``m = 8 × A = 8``."""
    value = _number(answer)
    if isinstance(value, str):
        return value
    if value == 80:
        return None
    if value == 10:
        return (
            "10 counts updates; BatchNorm updates its running statistics in every forward "
            "pass, and a window of A = 8 makes 8 of them"
        )
    if value == 8:
        return "8 is one window's passes; the run makes 10 windows"
    if value == 640:
        return "640 counts examples; BatchNorm counts forward passes (microbatches)"
    return f"{value:g}: count the forward passes of 10 windows of A = 8 microbatches"


batchnorm_passes = Exercise(
    name="batchnorm_passes",
    checker=check_batchnorm_passes,
    hints=("BatchNorm's num_batches_tracked grows by one per forward pass in training mode.",),
    reference="batchnorm_passes = 80  # 10 windows × A = 8 forward passes",
    kind="prediction",
    answer=80,
)

examples_at_16_updates = number_prediction(
    __name__, "examples_at_16_updates", 128,
    what="examples seen by the A = 1 run (m = 8, 8 examples per update) after 16 updates",
    mistakes={512: "what the A = 4 runs saw in their 16 updates (32 examples each); the A = 1 "
                   "run takes 8 per update",
              16: "the updates themselves, not the examples they used",
              64: "the A = 1 run's updates over the whole 512 examples"},
    hints=("Examples per update = m × A; the A = 1 run uses 8 per update.",),
    reasoning="The A = 1 run updates after every 8 examples (m = 8 × A = 1), so after 16 "
              "updates it has seen 16 × 8 = 128 examples, a quarter of the 512 the A = 4 runs "
              "have used by their update 16: the update axis compares unequal amounts of data.",
)


# ---------------------------------------------------------------- the examples axis


def held_out_run(
    model: nn.Module,
    train_examples: Sequence[Example],
    held_out: Mapping[str, Tensor],
    accumulation_steps: int,
    lr: float,
    *,
    micro_batch_size: int = 8,
    every: int = 64,
) -> tuple[Ledger, RunCurve]:
    """Section 4's run: a copy of ``model`` trained once over ``train_examples``
    (shuffled with seed 0) in microbatches of ``micro_batch_size``, ``accumulation_steps``
    per update, by :func:`accumlab.train` with AdamW at ``lr`` and the token-weighted
    objective; the token-mean loss on ``held_out`` (a collated batch, nats per target, in
    eval mode) measured before training and after every update that brings the examples
    seen to a multiple of ``every``. Returns the ledger and the curve (held-out loss,
    applied updates and examples seen at each measurement). ``every`` must be a multiple
    of the examples per update, so that no measurement point is skipped."""
    per_update = micro_batch_size * accumulation_steps
    if every % per_update:
        raise ValueError(f"every={every} is not a multiple of the {per_update} examples per "
                         "update; measurements would skip points")
    tokens = NextTokenLoss()
    model = copy.deepcopy(model)

    def loss() -> float:
        with torch.no_grad():
            logits = model.eval()(held_out["input_ids"])
        model.train()
        return float(tokens.loss_sum(logits, held_out)) / tokens.count(held_out)

    values, updates, seen = [loss()], [0], [0]
    ran = {"updates": 0, "examples": 0}

    def measure(report: Any) -> None:  # after every update
        ran["updates"] += 1
        ran["examples"] += report.examples
        if ran["examples"] % every == 0:
            values.append(loss())
            updates.append(ran["updates"])
            seen.append(ran["examples"])

    ledger = train(model, microbatches(list(train_examples), micro_batch_size, shuffle=True, seed=0),
                   torch.optim.AdamW(model.parameters(), lr=lr),
                   AccumulationPlan(micro_batch_size, accumulation_steps), tokens,
                   progress=False, on_update=measure)
    return ledger, run_curve(values, updates=updates, seen=seen)


# ---------------------------------------------------------------- in-batch negatives


def info_nce(queries: Tensor, keys: Tensor, temperature: float = 0.1) -> Tensor:
    """Contrastive loss with in-batch negatives, the mean over the ``n`` pairs (nats).

    ``queries`` and ``keys`` are (n, dim) embeddings; pair ``i`` is ``(queries[i],
    keys[i])``: each query must pick its own key among *all* ``n`` keys, so every other
    key in the batch is a negative and one pair's loss depends on every other pair.
    """
    if queries.dim() != 2 or queries.shape != keys.shape:
        raise ValueError(
            f"queries and keys must both be (n, dim); got {tuple(queries.shape)} and "
            f"{tuple(keys.shape)}"
        )
    scores = F.normalize(queries, dim=1) @ F.normalize(keys, dim=1).T / temperature
    return F.cross_entropy(scores, torch.arange(len(queries), device=scores.device))


def reference_contrastive_window(
    model: nn.Module, window: Window, loss_fn: Callable[[Tensor, Tensor], Tensor]
) -> None:
    """Fill ``.grad`` with the whole window's ``loss_fn`` gradient, one microbatch at a time."""
    with torch.no_grad():  # 1. every embedding of the window, without graphs (small)
        queries = torch.cat([model(mb["queries"]) for mb in window]).requires_grad_()
        keys = torch.cat([model(mb["keys"]) for mb in window]).requires_grad_()
    loss_fn(queries, keys).backward()  # 2. d(window loss)/d(each embedding)
    start = 0
    for mb in window:  # 3. recompute each microbatch with its graph, push those gradients in
        rows = slice(start, start + len(mb["queries"]))
        torch.autograd.backward(
            [model(mb["queries"]), model(mb["keys"])], [queries.grad[rows], keys.grad[rows]]
        )
        start = rows.stop


def _encoder(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))


def _pairs(seed: int, n: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(n, 6, generator=g)
    return {"queries": queries, "keys": queries + 0.5 * torch.randn(n, 6, generator=g)}


class _GradRows:
    """Counts the most rows the model ran on with autograd recording, in one call."""

    def __init__(self, model: nn.Module) -> None:
        self.most = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled():
            self.most = max(self.most, int(inputs[0].shape[0]))


def _diagnose_contrastive(model: nn.Module, window: Window, got: Tensor) -> str | None:
    n, a = sum(len(mb["queries"]) for mb in window), len(window)
    per_mb = [
        _grad_of(model, lambda mb=mb: info_nce(model(mb["queries"]), model(mb["keys"])))
        for mb in window
    ]
    sizes = [len(mb["queries"]) for mb in window]
    known = [
        (sum(g * s / n for g, s in zip(per_mb, sizes, strict=True)),
         "it is the accumulated per-microbatch loss: each query saw only its own microbatch's "
         "keys as negatives. With in-batch negatives that is a different (easier) loss, not "
         "the window's; every query needs all the window's keys"),
        (sum(per_mb) / a, "it is the average of per-microbatch losses: each query saw only its "
         "microbatch's keys as negatives; every query needs all the window's keys"),
        (sum(per_mb), "it is the sum of per-microbatch losses: each query saw only its "
         "microbatch's keys as negatives; every query needs all the window's keys"),
    ]
    for expected, message in known:
        if _close(got, expected):
            return message
    return None


def check_contrastive_window(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` fills ``.grad`` with the window's in-batch-negatives gradient
    while running the model with autograd on at most one microbatch at a time."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    with torch.random.fork_rng(devices=[]):
        for seed, sizes in enumerate(([5, 3, 4], [2, 5, 3, 6]), start=70):
            model = _encoder(seed)
            batch = _pairs(seed, sum(sizes))
            ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
            window = [{k: v[end - n : end] for k, v in batch.items()}
                      for n, end in zip(sizes, ends, strict=True)]
            reference = _grad_of(model, lambda m=model, b=batch: info_nce(m(b["queries"]),
                                                                          m(b["keys"])))
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.zero_grad(set_to_none=True)
            rows = _GradRows(model)
            try:
                answer(model, window, info_nce)
            finally:
                rows.handle.remove()
            where = f"on microbatches of {sizes} pairs"
            problem = fills_grad_only(model, weights, where)
            if problem is not None:
                return problem
            got = _flat(gradients(model))
            if rows.most > max(sizes):
                return (
                    f"{where}: the model ran with gradients on {rows.most} rows at once, more "
                    f"than a microbatch ({max(sizes)}): that holds the large batch's "
                    "activations, which accumulation exists to avoid; embed without gradients "
                    "first, then recompute one microbatch at a time"
                )
            if _close(got, reference):
                continue
            mistake = _diagnose_contrastive(model, window, got)
            if mistake is not None:
                return f"{where}: {mistake}"
            error = float((got - reference).abs().max() / reference.abs().max())
            return (
                f"{where}: the gradient differs from the whole window's loss (max relative "
                f"error {error:.3g} > {RTOL:g})"
            )
    return None


contrastive_window = Exercise(
    name="contrastive_window",
    checker=check_contrastive_window,
    hints=(
        "Accumulating loss_fn per microbatch gives each query only its microbatch's keys as "
        "negatives: a different loss. The window loss needs every embedding at once.",
        "Embeddings are small: compute all of them under torch.no_grad(), concatenate, "
        "mark them requires_grad_(), and backward loss_fn on them: .grad of each embedding "
        "is d(window loss)/d(embedding).",
        "Then, one microbatch at a time, recompute its embeddings with autograd on and call "
        "torch.autograd.backward([q, k], [q_grad_rows, k_grad_rows]).",
    ),
    reference=inspect.getsource(reference_contrastive_window),
)
