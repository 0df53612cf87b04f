"""Exercises for notebook 08 (audit the job you run: a Trainer, its count, a callback).

- ``factor_predicted`` (predict first): the factor by which a Hugging Face ``Trainer``
  scales the gradient of GPT-2 as built from its config, on the notebook's window of 8
  examples with labels on every real token: the loss scores the targets after the shift
  (95), the Trainer divides by the labels it counted before the shift (103).
- ``first_label_masked`` (transfer): the fix that holds under every ``transformers``
  release, in the data instead of the model. Write ``first_label_masked(batch) -> batch``:
  the collated batch (``input_ids``, ``attention_mask``, ``labels``, right-padded, labels
  not shifted) with every row's first label set to -100 and everything else unchanged.
  The label at position 0 is never a target (nothing predicts a row's first token), so
  the loss is the same, and a count taken before the shift now equals the targets. The
  checker tries batches the notebook did not show, then audits a real ``Trainer`` job
  (GPT-2 from its config, labels on every token) that collates through the answer.
"""

from __future__ import annotations

import inspect
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..data import VOCAB_SIZE, collate, load_examples
from . import Exercise
from .predictions import number_prediction

#: The notebook's window: 8 short examples (103 real tokens), labels on every real token.
WINDOW_LABELS = 103
WINDOW_TARGETS = 95  # one fewer per row: nothing predicts a row's first token

factor_predicted = number_prediction(
    __name__,
    "factor_predicted",
    WINDOW_TARGETS / WINDOW_LABELS,
    what="the applied gradient divided by the full-batch one, a number near 1",
    mistakes={
        1.0: "what a count of the scored targets would give; this count holds more",
        WINDOW_LABELS / WINDOW_TARGETS: (
            "the inverse: a larger denominator makes every contribution, and the gradient, smaller"
        ),
        0.25: "1/A: the Trainer divides by its count only, never by A as well",
    },
    hints=(
        "The model divides its summed loss by num_items_in_batch; the full-batch gradient "
        "divides the same sum by the targets the loss scores.",
        "Each of the 8 rows has one label the loss never scores (its first: nothing predicts "
        "it), and the Trainer counted it: 103 counted, 103 - 8 scored.",
    ),
    reasoning=(
        "The loss sums the cross-entropy over the 95 targets after the shift and is divided "
        "by the Trainer's count, 103 (labels before the shift, every row's first label "
        "included); the full-batch gradient divides the same sum by 95. Every contribution, "
        "so the whole gradient, is scaled by 95 / 103."
    ),
)


# ---------------------------------------------------------------- transfer: the collator fix


def reference_first_label_masked(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``batch`` with every row's first label -100; the other entries are the same tensors."""
    labels = batch["labels"].clone()  # a copy: the caller's batch stays as it was
    labels[:, 0] = -100  # never a target: nothing predicts a row's first token
    return {**batch, "labels": labels}


def _batches() -> list[dict[str, Tensor]]:
    """Batches the notebook does not show: prompt masked or not, one row or several, a row
    whose labels are all -100."""
    examples = load_examples(limit=40)
    masked_prompt = collate(examples[10:13])
    empty_row = collate(examples[20:22], mask_prompt=False)
    empty_row["labels"][1] = -100
    return [
        collate(examples[30:33], mask_prompt=False),
        collate(examples[33:34], mask_prompt=False),
        masked_prompt,
        empty_row,
    ]


def _batch_problem(answer: Callable[[Any], Any]) -> str | None:
    for batch in _batches():
        given = {k: v.clone() for k, v in batch.items()}
        out = answer(given)
        if not isinstance(out, Mapping) or "labels" not in out:
            return f"return the batch (a dict with labels), got {type(out).__name__}"
        if set(out) != set(batch):
            return f"keep the batch's entries {sorted(batch)}; the answer has {sorted(out)}"
        for key in batch:
            if key != "labels" and not torch.equal(out[key], batch[key]):
                return f"{key} changed: only the labels change (the model still reads every token)"
        labels, before = out["labels"], batch["labels"]
        if labels.shape != before.shape:
            return f"labels must keep their shape {tuple(before.shape)}, got {tuple(labels.shape)}"
        if not torch.equal(labels[:, 1:], before[:, 1:]):
            return (
                "labels after position 0 changed: those are the targets the loss scores, keep "
                "them (do not shift the labels: the model shifts them itself)"
            )
        rows = [r for r in range(labels.shape[0]) if labels[r, 0] != -100]
        if rows:
            return f"row {rows[0]} still has a label at position 0; set labels[:, 0] to -100"
    return None


def _audit_with(answer: Callable[[Any], Any]) -> str | None:
    """Audit GPT-2 from its config under a real Trainer whose collator calls ``answer``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers import logging as hf_logging

    from ...hf import audit_trainer

    hf_logging.set_verbosity_error()
    examples = [ex for ex in load_examples(limit=200) if len(ex.input_ids) <= 20][:8]

    def data_collator(features: list[Any]) -> dict[str, Tensor]:
        batch = collate(features, mask_prompt=False)
        del batch["example_ids"]
        return dict(answer(batch))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        config = GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_positions=64,
            n_embd=16,
            n_layer=1,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=1,
        )
        model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            max_steps=1,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=examples, data_collator=data_collator
        )
        report = audit_trainer(trainer)
    if report.ok:
        return None
    return f"the audit of a Trainer collating through your function is not ok: {report.mistakes}"


def check_first_label_masked(answer: Any) -> str | None:
    """None when ``answer`` masks every row's first label and nothing else, and a real
    Trainer job collating through it passes the audit; else what is wrong."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    return _batch_problem(answer) or _audit_with(answer)


first_label_masked = Exercise(
    name="first_label_masked",
    checker=check_first_label_masked,
    hints=(
        "Only the labels change, and only their first column: labels[:, 0] is never a "
        "target, so setting it to -100 leaves the loss as it was.",
        "Clone the labels, set column 0 to -100, and return a new dict with the other "
        "entries as they were: {**batch, 'labels': labels}.",
    ),
    reference=inspect.getsource(reference_first_label_masked),
)
