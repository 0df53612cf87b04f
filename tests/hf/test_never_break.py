"""The audit never breaks the run it watches, and judges the job as it is configured.

``AuditCallback`` raises into ``trainer.train()`` only when asked to stop on a found
mistake; any failure of its own becomes a "not checked" report and a warning, and the
run's weights are bit for bit those of the run without it. ``audit_trainer`` returns a
"not checked" report instead of raising for a Trainer it cannot follow. A split the job
never runs is a note, not a mistake; a window without targets and non-finite weights or
gradients get plain messages, not a cause of loss normalization.

Each test here failed on the code before (noted in its docstring).
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

from helpers import hf_jobs as hj  # noqa: E402
from helpers import hf_rl  # noqa: E402
from helpers import hf_workers as hw  # noqa: E402

import accumlab.hf as ah  # noqa: E402
from accumlab.hf.callback import AccumulationWarning, AuditCallback  # noqa: E402

transformers.logging.set_verbosity_error()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(trainer, callback=None):
    """``trainer.train()`` (with ``callback`` added): the trainer and the audit's warnings."""
    if callback is not None:
        trainer.add_callback(callback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [str(w.message) for w in caught if issubclass(w.category, AccumulationWarning)]


def test_grpo_is_audited_and_its_run_trains_as_without_the_callback():
    """TRL's GRPOTrainer hands training_step a list of dataset rows: the capture's
    ``dict(inputs)`` raised ValueError out of audit_trainer and, with the callback, out
    of trainer.train() (where the run without it trains)."""
    report = ah.audit_trainer(hf_rl.build("grpo", "dapo", **hj.SGD))
    assert report.checked and report.ok, str(report)
    settings = {**hj.SGD, "max_steps": 2}
    callback = AuditCallback(on_mistake="raise")
    audited, said = train(hf_rl.build("grpo", "dapo", **settings), callback)
    plain, _ = train(hf_rl.build("grpo", "dapo", **settings))
    assert same(weights(audited.model), weights(plain.model)) and said == []
    (checked,) = callback.reports
    assert checked.checked and checked.ok and checked.invariance, str(checked)


@pytest.fixture(scope="module")
def plain_run():
    """Two updates of a correct GPT-2 job with dropout, without the callback."""
    trainer = hw.make_trainer(hw.model_for("loss_type", dropout=0.1), hw.make_args(max_steps=2))
    trainer.train()
    return weights(trainer.model)


@pytest.mark.parametrize("where", ["measure", "record"])
def test_a_failure_of_the_audit_is_a_report_never_an_error(monkeypatch, plain_run, where):
    """An error while measuring (before: it left train() as the exception) or while
    recording a microbatch: the run finishes as without the callback, even with
    on_mistake="raise", and the report says "not checked" and why."""
    import accumlab.hf.audit as audit
    import accumlab.hf.capture as capture

    def broken(*args, **kwargs):
        raise RuntimeError("something the audit did not expect")

    monkeypatch.setattr(*((audit, "diagnose", broken) if where == "measure" else (capture, "clone_inputs", broken)))
    callback = AuditCallback(steps=2, on_mistake="raise")
    trainer = hw.make_trainer(hw.model_for("loss_type", dropout=0.1), hw.make_args(max_steps=2))
    trainer, said = train(trainer, callback)
    assert same(weights(trainer.model), plain_run)
    assert callback.reports and not any(r.checked for r in callback.reports)
    assert "something the audit did not expect" in callback.reports[0].reason
    assert said and said[0].startswith("accumulation audit: not checked: the audit could")
    assert "training_step" not in vars(trainer) and "clip_grad_norm_" not in vars(trainer.accelerator)


def test_audit_trainer_returns_a_report_when_the_job_fails_inside_it(monkeypatch):
    import accumlab.hf.audit as audit

    def broken(*args, **kwargs):
        raise KeyError("prompt")

    monkeypatch.setattr(audit, "diagnose", broken)
    model = hw.model_for("loss_type")
    report = ah.audit_trainer(hw.make_trainer(model))
    assert not report.checked and "KeyError" in report.reason, str(report)
    assert all(p.grad is None for p in model.parameters())  # left as it was


class OwnLM(torch.nn.Module):
    """A language model of the user's own (GPT-2's body, a head of its own): an objective
    the audit does not know, so it is checked by split invariance."""

    def __init__(self) -> None:
        super().__init__()
        self.body = hw.gpt2().transformer
        self.head = torch.nn.Linear(16, hw.VOCAB, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return {"logits": self.head(hidden)}


class WindowMean(transformers.Trainer):
    """Its loss is its microbatch's own token mean: right only when the microbatch is the
    window (A = 1)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        targets = int((labels[:, 1:] != -100).sum())
        loss = hw.shifted_sum(outputs, labels) / targets
        return (loss, outputs) if return_outputs else loss


def test_a_split_the_job_does_not_run_is_a_note_not_a_mistake():
    """A = 1, m = 8: the job's update is the window's token mean (measured: 1e-7), yet the
    audit said num_items_ignored (it compared (8, 1) with (4, 2), a split the job never
    runs) and on_mistake="raise" stopped the run before its first update."""
    args = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
    g = hw.applied_gradient(OwnLM(), args, trainer_class=WindowMean)
    ref = hw.reference_gradient(OwnLM(), [hw.collate(hw.examples())])
    assert float((g - ref).norm() / ref.norm()) < 1e-5  # the job is right
    trainer = hw.make_trainer(OwnLM(), hw.make_args(**args), WindowMean)
    report = ah.audit_trainer(trainer)
    assert report.checked and report.ok and report.mistakes == [], str(report)
    assert report.invariance, str(report)
    assert any("at (1, 8), a split this job does not run" in n for n in report.notes), report.notes
    callback = AuditCallback(on_mistake="raise")
    trainer, said = train(hw.make_trainer(OwnLM(), hw.make_args(**{**args, "max_steps": 1}), WindowMean),
                          callback)
    assert trainer.state.global_step == 1 and callback.reports[0].ok and said == []


def _no_targets():
    def collate(features):
        batch = hw.collate(features)
        batch["labels"].fill_(-100)
        return batch
    return hw.make_trainer(hw.model_for("loss_type"), data_collator=collate)


def _mlm_no_mask():
    from transformers import DataCollatorForLanguageModeling, Trainer

    return Trainer(model=hj.masked_lm(), args=hj.training_args(), train_dataset=hj.lm_examples(),
                   data_collator=DataCollatorForLanguageModeling(hj.tokenizer(), mlm_probability=0.0))


def _nan_weight():
    model = hw.model_for("loss_type")
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    return hw.make_trainer(model)


@pytest.mark.parametrize(("build", "said"), [
    (_no_targets, "no target"),
    (_mlm_no_mask, "no target"),
    (_nan_weight, "weights hold NaN or inf"),
])
def test_no_target_and_non_finite_values_get_a_plain_message(build, said):
    """A window without a target (BERT's MLM collator masking nothing) and a NaN weight
    were named depends_on_split with scale nan, and the fix told the user to renormalize
    a loss that is fine. Now: not checked, in one plain sentence, and no fix; the callback
    with on_mistake="raise" lets the run go on."""
    report = ah.audit_trainer(build())
    assert not report.checked and report.mistakes == [] and report.fix == "", str(report)
    assert said in report.reason, report.reason
    callback = AuditCallback(on_mistake="raise")
    trainer = build()
    trainer.args.max_steps = 1
    trainer, warned = train(trainer, callback)
    assert trainer.state.global_step == 1 and warned and said in warned[0]
