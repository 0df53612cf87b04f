"""Jobs for the split-invariance checks, correct and wrong, in the styles users write, and
the truth each verdict is tested against, measured without the engine: the real update
read off the weights (SGD, lr 1, no momentum, no clipping, float64, dropout 0).

Every job here is window code, ``window(model, microbatches, accumulation_steps)``: forward
and backward for each microbatch, no step. ``real_update`` wraps it in a real training step
on a copy of the model, so the update it reads is what the job would train with.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from accumlab.loop_audit.controlled_set import AuditLM

IGNORE = -100
VOCAB = 13


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AuditLM(vocab_size=VOCAB).double()


def make_examples(n: int = 9, seed: int = 1, *, vocab: int = VOCAB, longest: int = 10) -> list[dict]:
    """``n`` token sequences of uneven length (3 to ``longest``) over ``vocab`` tokens, some
    with a prompt whose labels are masked, some without (their first label is a target)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, longest + 1, (1,), generator=g))
        prompt = int(torch.randint(0, 3, (1,), generator=g))
        out.append({"ids": torch.randint(0, vocab, (length,), generator=g).tolist(), "prompt": prompt})
    return out


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and unshifted ``labels`` (prompt and
    padding -100)."""
    width = max(len(e["ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for r, e in enumerate(examples):
        n = len(e["ids"])
        ids[r, :n] = torch.tensor(e["ids"])
        mask[r, :n] = 1
        labels[r, e["prompt"]:n] = torch.tensor(e["ids"][e["prompt"]:])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def targets(microbatches) -> int:
    """Targets after the shift over a list of microbatches."""
    return sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in microbatches)


def loss_sum(model, mb) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                           ignore_index=IGNORE, reduction="sum")


# -- window code -------------------------------------------------------------------------


def token_sum(model, microbatches, accumulation_steps):
    """Correct: each microbatch's loss sum over the window's targets."""
    total = targets(microbatches)
    for mb in microbatches:
        (loss_sum(model, mb) / total).backward()


def mean_over_a(model, microbatches, accumulation_steps):
    """The model's mean loss per microbatch over the configured A (what Lightning and
    Accelerate do to a mean loss)."""
    for mb in microbatches:
        (model(**mb).loss / accumulation_steps).backward()


def window_mean_over_a(model, microbatches, accumulation_steps):
    """The window's token mean, divided by A once more."""
    total = targets(microbatches)
    for mb in microbatches:
        (loss_sum(model, mb) / total / accumulation_steps).backward()


def means_summed(model, microbatches, accumulation_steps):
    """Each microbatch's mean loss, summed over the window."""
    for mb in microbatches:
        model(**mb).loss.backward()


def torchtune_style(model, microbatches, accumulation_steps):
    """torchtune's single-device recipe: labels counted before the shift, ``loss = mean ×
    count``, then ``scale_grads(model, 1 / num_tokens)``."""
    num_tokens = 0
    for mb in microbatches:
        count = (mb["labels"] != IGNORE).sum()
        num_tokens += count
        (model(**mb).loss * count).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(1 / num_tokens)


def torchtitan_style(model, microbatches, accumulation_steps):
    """torchtitan's train step: the window's valid tokens counted first, every microbatch's
    summed loss divided by them (labels already shifted by the data, here by the step)."""
    global_valid_tokens = sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in microbatches)
    for mb in microbatches:
        logits = model(input_ids=mb["input_ids"]).logits[:, :-1]
        shifted = mb["labels"][:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=IGNORE,
                               reduction="sum") / global_valid_tokens
        loss.backward()


def accelerate_jobs(accelerator):
    """Accelerate's documented loops as window code: the mean loss (``accelerator.backward``
    divides it by ``gradient_accumulation_steps``), and the token mean over the window
    multiplied back by A (its causal-LM accumulation guide)."""

    def mean_loss(model, microbatches, accumulation_steps):
        accelerator.gradient_accumulation_steps = accumulation_steps
        for mb in microbatches:
            with accelerator.accumulate(model):
                accelerator.backward(model(**mb).loss)

    def token_mean(model, microbatches, accumulation_steps):
        accelerator.gradient_accumulation_steps = accumulation_steps
        num_items_in_batch = targets(microbatches)
        for mb in microbatches:
            with accelerator.accumulate(model):
                loss = loss_sum(model, mb) / num_items_in_batch
                accelerator.backward(loss * accelerator.gradient_accumulation_steps)

    return mean_loss, token_mean


# -- the truth -----------------------------------------------------------------------------


def real_update(model, examples, window, sizes, accumulation_steps) -> torch.Tensor:
    """The update one SGD step (lr 1, no momentum) of ``window`` on ``examples`` cut into
    microbatches of ``sizes`` makes to a copy of ``model``, read off its weights (float64):
    minus the gradient the step applied."""
    copied = copy.deepcopy(model)
    optimizer = torch.optim.SGD(copied.parameters(), lr=1.0, momentum=0.0)
    before = torch.cat([p.detach().reshape(-1).clone() for p in copied.parameters()])
    optimizer.zero_grad(set_to_none=True)
    microbatches, first = [], 0
    for n in sizes:
        microbatches.append(collate(examples[first:first + n]))
        first += n
    window(copied, microbatches, accumulation_steps)
    optimizer.step()
    after = torch.cat([p.detach().reshape(-1) for p in copied.parameters()])
    return before - after


def token_mean_gradient(model, examples) -> torch.Tensor:
    """The token mean's gradient over ``examples``, one example at a time: each example's
    summed next-token loss over the window's targets (no padding at all)."""
    copied = copy.deepcopy(model)
    rows = [collate([e]) for e in examples]
    total = targets(rows)
    for row in rows:
        (loss_sum(copied, row) / total).backward()
    return torch.cat([p.grad.reshape(-1) for p in copied.parameters()])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖``."""
    return float((a - b).norm() / b.norm())


def factor(a: torch.Tensor, b: torch.Tensor) -> float:
    """The least-squares ``x`` in ``a ≈ x · b``, by its closed form."""
    return float(a.dot(b) / b.dot(b))
