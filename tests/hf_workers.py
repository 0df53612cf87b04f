"""Tiny Hugging Face jobs for the Trainer audit's tests, and its 2-rank workers.

Imported by ``tests/test_hf_audit*.py`` and by the spawned ranks of
``accumlab.distributed.launch`` (pytest puts ``tests/`` on ``sys.path``; spawn copies it).
Everything is built locally from tiny configs: no download.

The data: 8 examples of uneven length (3 to 11 tokens, 55 in all), labels equal to the
inputs and -100 on padding only, so a causal LM scores 55 - 8 = 47 targets while a count
taken before the shift finds 55: a Trainer dividing by 55 scales the gradient by 47/55.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LENGTHS = (3, 11, 5, 9, 4, 10, 6, 7)  # 55 labels, 47 targets after the shift
VOCAB = 64


def examples(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[dict[str, list[int]]]:
    """One example per length: random token ids in 1..VOCAB-1 (0 is the padding id)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def collate(features: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Right-pad to the longest example: attention mask 0 and labels -100 on padding."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, f in enumerate(features):
        x = torch.tensor(f["input_ids"])
        ids[i, : len(x)], mask[i, : len(x)], labels[i, : len(x)] = x, 1, x
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def collate_classes(features: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Sequence classification: the padded inputs and one class per example (its length % 3)."""
    batch = collate(features)
    batch["labels"] = torch.tensor([len(f["input_ids"]) % 3 for f in features])
    return batch


def gpt2(dropout: float = 0.0, seed: int = 0) -> nn.Module:
    """A GPT2LMHeadModel as built from a tiny config (1 layer, width 16): its loss_type unset."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(config)


def gpt2_classifier(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, num_labels=3,
        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2ForSequenceClassification(config)


class KwargsWrapper(nn.Module):
    """Accepts ``**kwargs`` (so the Trainer passes num_items_in_batch) but returns the inner
    model's own mean loss, ignoring the count."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, **kwargs: Any) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


class PlainWrapper(nn.Module):
    """A forward without ``**kwargs``: the Trainer cannot pass the count, divides by A."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def model_for(kind: str, dropout: float = 0.0) -> nn.Module:
    """``plain`` (as built), ``loss_type`` (ForCausalLM set), ``kwargs``/``nokw`` wrappers."""
    model = gpt2(dropout)
    if kind == "loss_type":
        model.loss_type = "ForCausalLM"
    elif kind == "kwargs":
        model = KwargsWrapper(model)
    elif kind == "nokw":
        model = PlainWrapper(model)
    elif kind != "plain":
        raise ValueError(kind)
    return model


def shifted_sum(outputs: Any, labels: Tensor) -> Tensor:
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def correct_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """The right compute_loss_func: summed shifted cross-entropy / num_items_in_batch."""
    return shifted_sum(outputs, labels) / num_items_in_batch


def twice_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """Divides by the count and again by the accumulation steps (4)."""
    return shifted_sum(outputs, labels) / num_items_in_batch / 4


def never_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """Never divides: the loss sum itself."""
    return shifted_sum(outputs, labels)


def make_args(out: str | None = None, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    settings: dict[str, Any] = dict(
        per_device_train_batch_size=2, gradient_accumulation_steps=4, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    settings.update(overrides)
    return TrainingArguments(out or tempfile.mkdtemp(prefix="hf_audit_"), **settings)


def make_trainer(model: nn.Module, args: Any = None, trainer_class: Any = None, **kw: Any) -> Any:
    from transformers import Trainer

    kw.setdefault("train_dataset", examples())
    kw.setdefault("data_collator", collate)
    return (trainer_class or Trainer)(model=model, args=args or make_args(), **kw)


# -- 2-rank workers (run under accumlab.distributed.launch) ----------------------------


def _rank_lengths(rank: int) -> tuple[int, ...]:
    """Uneven data across ranks: rank 0's examples are short, rank 1's long."""
    return LENGTHS[:4] if rank == 0 else LENGTHS[4:] + (12, 2, 8, 5)


def ddp_audit(kind: str, average_tokens: bool, fix: bool = False) -> dict[str, Any]:
    """Audit a 2-rank job under ``torch.distributed`` (each rank has its own examples:
    ``DistributedSampler`` shards the 16 examples); return the verdict and numbers."""
    import transformers

    import accumlab.hf as ah

    transformers.logging.set_verbosity_error()
    rank = int(os.environ["RANK"])
    model = model_for(kind)
    args = make_args(average_tokens_across_devices=average_tokens, gradient_accumulation_steps=2)
    trainer = make_trainer(model, args, train_dataset=examples(LENGTHS + (12, 2, 8, 5, 9, 3, 11, 4)))
    report = ah.audit_trainer(trainer)
    if fix and report.fix:
        namespace = {"model": model, "trainer": trainer, "args": args,
                     "train_dataset": trainer.train_dataset, "data_collator": collate}
        exec(report.fix, namespace)
        if report.fix_needs_new_trainer:
            trainer = make_trainer(model, args, train_dataset=trainer.train_dataset,
                                   data_collator=trainer.data_collator)
        report = ah.audit_trainer(trainer)
    w = report.windows[0] if report.windows else None
    return {
        "rank": rank,
        "ok": report.ok,
        "mistakes": report.mistakes,
        "scale": report.scale,
        "relative_error": report.relative_error,
        "targets": None if w is None else w.targets,
        "rank_targets": None if w is None else w.rank_targets,
        "ranks": None if w is None else w.ranks,
        "text": str(report),
    }
