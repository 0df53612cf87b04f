"""Lightning jobs for tests/lightning: a tiny GPT-2 (from a config, dropout 0) on padded
examples of uneven length, in two modules (the mean loss ``self.model(**batch).loss``, and
a correct token-sum module), and the truth each verdict is tested against, measured
without accumlab: the real updates of SGD (lr 1) read off the weights at every step, and
the token mean computed one example at a time."""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import torch
import torch.nn.functional as F

from helpers import hf_models, invariance_jobs

IGNORE = -100
VOCAB = 50
M, A = 2, 4


def examples(n: int = 10, seed: int = 1) -> list[dict]:
    """``n`` sequences of 3-11 tokens, some with a masked prompt; each carries the target
    count of its window of ``M × A`` examples (``window_targets``), as a data pipeline that
    knows its windows gives it."""
    out = invariance_jobs.make_examples(n, seed, vocab=VOCAB, longest=11)
    for k in range(0, n, M * A):
        window = out[k:k + M * A]
        total = sum(targets_of(e) for e in window)
        for e in window:
            e["window_targets"] = total
    return out


def targets_of(example: dict) -> int:
    """Targets after the shift: positions 1.. whose label is not masked."""
    return len(example["ids"]) - max(example["prompt"], 1)


def gpt2() -> torch.nn.Module:
    """The jobs' GPT-2 (``hf_models.gpt2``): ``VOCAB`` tokens, 32 positions, dropout 0."""
    return hf_models.gpt2(vocab=VOCAB, positions=32, bos_token_id=0, eos_token_id=0)


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """``invariance_jobs.collate``'s microbatch, with the window's target count where the
    examples carry it."""
    batch = invariance_jobs.collate(items)
    if all("window_targets" in e for e in items):
        batch["window_targets"] = torch.tensor([e["window_targets"] for e in items])
    return batch


class Module(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0, momentum=0.0)


class MeanLoss(Module):
    """``return self.model(**batch).loss``: each microbatch's mean, Lightning divides by A."""

    def training_step(self, batch, batch_idx):
        inputs = {k: v for k, v in batch.items() if k != "window_targets"}
        loss = self.model(**inputs).loss
        self.log("train_loss", loss)
        return loss


class TokenSum(Module):
    """Correct: each microbatch's summed loss over the window's targets, times the A
    Lightning divides by."""

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                   ignore_index=IGNORE, reduction="sum")
        return loss_sum / batch["window_targets"][0] * self.trainer.accumulate_grad_batches


class Updates(L.Callback):
    """The weights before every optimizer step, and after the run: the updates."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before.append(flat(pl_module))

    def applied(self, pl_module) -> list[torch.Tensor]:
        """What each step applied: the weights before it minus those after it."""
        points = self.before + [flat(pl_module)]
        return [a - b for a, b in zip(points, points[1:], strict=False)]


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def fit(module_class, data: list[dict], batch_size: int, accumulate: int, callbacks=(),
        weights: torch.Tensor | None = None):
    """Train ``module_class`` on a fresh GPT-2 for one epoch over ``data``; the module, the
    gradient each SGD step applied (lr 1: the weights before it minus after it) and the
    warnings the run gave. ``weights``: where the model starts (flat), else GPT-2's seed 0."""
    model = gpt2()
    if weights is not None:
        torch.nn.utils.vector_to_parameters(weights, model.parameters())
    module = module_class(model)
    updates = Updates()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[updates, *callbacks])
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, collate_fn=collate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    return module, updates.applied(module), caught


def token_mean_gradient(data: list[dict], weights: torch.Tensor | None = None) -> torch.Tensor:
    """The token mean's gradient over ``data``, one example at a time, at the initial weights
    or at ``weights`` (flat, in ``parameters()`` order)."""
    model = gpt2()
    if weights is not None:
        torch.nn.utils.vector_to_parameters(weights, model.parameters())
    total = sum(targets_of(e) for e in data)
    for e in data:
        batch = collate([{k: v for k, v in e.items() if k != "window_targets"}])
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                               ignore_index=IGNORE, reduction="sum")
        (loss / total).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def factor(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(a.dot(b) / b.dot(b))
