"""When the audit's reference cannot run on a job, split invariance on the job's own path
speaks instead of "not checked".

Three jobs the audit declined before, each judged by its real updates (SGD at learning
rate 1, read off the weights) at the configured split against the whole window as one
microbatch:

- a wrapper module whose ``forward(input_ids, labels, attention_mask, **kwargs)`` needs
  its labels and returns its own per-microbatch mean, ignoring the ``num_items_in_batch``
  it accepts ("not checked: the reference forward pass of KwargsIgnorer failed:
  'NoneType' object is not subscriptable"; a week before, it was named, scale x 4);
- a collator whose ``shift_labels`` are ``labels[:, 1:]`` (one shorter), read by the
  job's own ``compute_loss`` ("not checked ... size 16 vs 15");
- a Trainer subclass whose loss is a per-sequence mean divided by A, over 7 examples
  split (2, 2, 2, 1) ("not checked: the gradient is no weighting of the token mean"; its
  gradient is 1/A times the sum of its microbatches' own: average_of_averages).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from helpers import hf_workers as hw  # noqa: E402

import accumlab.hf as ah  # noqa: E402

transformers.logging.set_verbosity_error()
WHOLE = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}


class KwargsIgnorer(torch.nn.Module):
    """Needs its labels; takes **kwargs (so the Trainer passes num_items_in_batch and no
    longer divides by A) and returns its own microbatch's token mean."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = hw.gpt2()
        self.config = self.inner.config

    def forward(self, input_ids, labels, attention_mask, **kwargs):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def collate_shift_labels(features):
    batch = hw.collate(features)
    batch["shift_labels"] = batch["labels"][:, 1:]  # one shorter than the inputs; the Trainer counts it
    return batch


class ShiftLabelsTrainer(transformers.Trainer):
    """Reads the collator's one-shorter shift_labels; ``form`` "sum": the summed
    cross-entropy over num_items_in_batch (right), "mean": its microbatch's own mean."""

    form = "sum"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        targets = inputs.pop("shift_labels")
        inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                               reduction="sum")
        loss = loss / (num_items_in_batch if self.form == "sum" else int((targets != -100).sum()))
        return (loss, outputs) if return_outputs else loss


class MeanShift(ShiftLabelsTrainer):
    form = "mean"


class PerSequenceMean(transformers.Trainer):
    """Each sequence's token mean, averaged over the microbatch, divided by A."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        targets = labels[:, 1:]
        per_token = F.cross_entropy(outputs.logits[:, :-1].transpose(1, 2), targets, ignore_index=-100,
                                    reduction="none")
        per_sequence = per_token.sum(1) / (targets != -100).sum(1)
        loss = per_sequence.mean() / self.args.gradient_accumulation_steps
        return (loss, outputs) if return_outputs else loss


JOBS = {  # name: (model, trainer class, trainer keywords, the names the audit gives)
    "kwargs_ignorer": (KwargsIgnorer, None, {}, ["num_items_ignored"]),
    "shift_labels_sum": (lambda: hw.model_for("loss_type"), ShiftLabelsTrainer,
                         {"data_collator": collate_shift_labels}, []),
    "shift_labels_mean": (lambda: hw.model_for("loss_type"), MeanShift,
                          {"data_collator": collate_shift_labels}, ["num_items_ignored"]),
    "per_sequence_mean_7": (lambda: hw.model_for("loss_type"), PerSequenceMean,
                            {"train_dataset": hw.examples()[:7]}, ["average_of_averages"]),
}


@pytest.mark.parametrize("name", list(JOBS))
def test_a_job_the_reference_cannot_run_is_checked_by_split_invariance(name):
    model, cls, kw, names = JOBS[name]
    whole = {**WHOLE, "per_device_train_batch_size": len(kw.get("train_dataset", hw.examples()))}
    configured = hw.applied_gradient(model(), trainer_class=cls, **kw)
    one_batch = hw.applied_gradient(model(), whole, trainer_class=cls, **kw)
    true_factor = float(configured.dot(one_batch) / one_batch.dot(one_batch))
    true_error = float((configured - one_batch).norm() / one_batch.norm())
    report = ah.audit_trainer(hw.make_trainer(model(), trainer_class=cls, **kw))
    assert report.checked and report.invariance, str(report)  # was "not checked"
    assert report.mistakes == names and report.ok is (true_error < 1e-5), (true_error, str(report))
    split = report.invariance[0].own  # the configured split against the whole window as one
    assert split.factor == pytest.approx(true_factor, rel=1e-4), str(report)
    assert split.relative_error == pytest.approx(true_error, rel=1e-3, abs=1e-5)
    if name == "kwargs_ignorer":  # named, x 4 as a week before
        assert 3.5 < split.factor < 4.5, str(report)
