"""docs/AUDIT.md shows audit_trainer's report on GPT-2 from its config (lesson 08's job):
the lines it prints are the ones the audit prints today."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from helpers.hf_models import gpt2

transformers = pytest.importorskip("transformers")

from accumlab.hf import audit_trainer  # noqa: E402
from accumlab_course.data import VOCAB_SIZE, collate, load_examples  # noqa: E402

AUDIT_DOC = Path(__file__).resolve().parents[2] / "docs" / "AUDIT.md"


def lesson_08_report() -> str:
    """The audit of lesson 08's job: GPT-2 from its config, 8 short examples labelled on
    every token, m = 2, A = 4."""
    from transformers import Trainer, TrainingArguments

    transformers.logging.set_verbosity_error()
    examples = [ex for ex in load_examples() if len(ex.input_ids) <= 16][:8]
    model = gpt2(vocab=VOCAB_SIZE, positions=128, width=32, layers=2, bos_token_id=1, eos_token_id=1)

    def lm_batch(batch_examples):
        batch = collate(batch_examples, mask_prompt=False)
        del batch["example_ids"]
        return batch

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            max_steps=1,
            max_grad_norm=0.0,
            seed=0,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=lm_batch)
        return str(audit_trainer(trainer))


def test_the_documented_report_is_what_the_audit_prints():
    text = AUDIT_DOC.read_text(encoding="utf-8")
    section = text.partition("\n## A Hugging Face `Trainer`\n")[2]
    block = re.search(r"^```text\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert block, "docs/AUDIT.md has no text block under '## A Hugging Face `Trainer`'"
    shown = block.group(1).rstrip("\n").split("\n")
    printed = lesson_08_report().split("\n")
    # the page elides the end of the last line it shows with '...'
    *whole, last = shown
    assert last.endswith(", ...")
    assert whole == printed[: len(whole)]
    assert printed[len(whole)].startswith(last.removesuffix(" ..."))
