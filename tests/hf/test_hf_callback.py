"""accumlab.hf.AuditCallback: the first optimizer steps of a real Trainer run, audited.

A correct job gives no warning; GPT-2 as built from its config (the Trainer counts its
labels before the shift) gives a warning naming the cause; ``on_mistake="raise"`` stops
the run before the first update is applied; after the audited steps nothing of the
callback is left in the training path and the run trains bit for bit as without it.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.hf_models import gpt2  # noqa: E402
from transformers import PrinterCallback, Trainer, TrainingArguments  # noqa: E402

from accumlab.hf import AuditCallback  # noqa: E402
from accumlab.hf.callback import AccumulationError, AccumulationWarning  # noqa: E402
from accumlab_course.data import VOCAB_SIZE, collate, load_examples  # noqa: E402

M, A = 2, 4  # examples per microbatch, microbatches per window


@pytest.fixture(autouse=True)
def quiet():
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield


def tiny_gpt2(*, loss_type: str | None = None, dropout: float = 0.0) -> torch.nn.Module:
    model = gpt2(vocab=VOCAB_SIZE, positions=128, dropout=dropout, bos_token_id=1, eos_token_id=1)
    if loss_type is not None:
        model.loss_type = loss_type
    return model


def lm_batch(examples):
    """Labels on every real token (-100 on padding only), as in pretraining: the label at
    position 0 is one no loss scores, so a count before the shift is off."""
    batch = collate(examples, mask_prompt=False)
    del batch["example_ids"]
    return batch


EXAMPLES = load_examples(limit=M * A * 4)


def trainer_for(model, tmp_path, callbacks=(), *, max_steps=3, cls=Trainer, **overrides):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=M,
        gradient_accumulation_steps=A,
        max_steps=max_steps,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        **overrides,
    )
    trainer = cls(
        model=model,
        args=args,
        train_dataset=EXAMPLES,
        data_collator=lm_batch,
        callbacks=list(callbacks),
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def audit_warnings(record):
    return [w for w in record if issubclass(w.category, AccumulationWarning)]


def test_a_correct_job_gives_no_warning(tmp_path):
    callback = AuditCallback(steps=2)
    trainer = trainer_for(tiny_gpt2(loss_type="ForCausalLM"), tmp_path, [callback])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert audit_warnings(record) == []
    assert len(callback.reports) == 2
    for report in callback.reports:
        assert report.ok, str(report)
        assert abs(report.scale - 1) < 1e-5 and report.relative_error < 1e-5


def test_dropout_is_replayed_so_a_correct_job_with_dropout_is_ok(tmp_path):
    """The reference runs each microbatch on the random state it trained with: the same
    dropout masks, so a correct job matches to float rounding, not to dropout noise."""
    callback = AuditCallback()
    trainer_for(tiny_gpt2(loss_type="ForCausalLM", dropout=0.3), tmp_path, [callback]).train()
    (report,) = callback.reports
    assert report.ok and report.relative_error < 1e-5, str(report)


def test_gpt2_from_its_config_warns_and_names_the_cause(tmp_path):
    callback = AuditCallback()
    trainer = trainer_for(tiny_gpt2(), tmp_path, [callback])
    with pytest.warns(AccumulationWarning) as record:
        trainer.train()
    (report,) = callback.reports
    assert not report.ok
    message = str(record[0].message)
    assert message == str(report)
    assert report.mistakes == ["count_before_shift"]
    # the count includes position 0 of each row, a label no loss scores: 8 rows per window
    (window,) = report.windows
    assert window.trainer_count == window.targets + M * A
    assert report.scale == pytest.approx(window.targets / window.trainer_count, rel=1e-4)
    assert "before the causal shift" in message and "trainer.data_collator" in report.fix


def test_raise_stops_the_run_before_the_first_update(tmp_path):
    model = tiny_gpt2()
    before = weights(model)
    trainer = trainer_for(model, tmp_path, [AuditCallback(on_mistake="raise")])
    with pytest.raises(AccumulationError) as info:
        trainer.train()
    assert not info.value.report.ok and str(info.value) == str(info.value.report)
    assert same_weights(weights(model), before)  # no update applied
    assert trainer.state.global_step == 0
    assert all(not s for s in trainer.optimizer.state.values())  # AdamW made no state yet
    assert "training_step" not in vars(trainer)  # the wrapper is gone


@pytest.mark.parametrize("loss_type", ["ForCausalLM", None], ids=["correct", "gpt2-config"])
def test_after_the_audited_steps_the_run_is_bit_identical(tmp_path, loss_type):
    """Audit the first update of three (dropout on: the random state must be put back),
    then compare every weight with a run without the callback, bit for bit."""
    seen = {}

    class Spy(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen[state.global_step] = "training_step" in vars(trainer)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AccumulationWarning)
        callback = AuditCallback(steps=1)
        trainer = trainer_for(
            tiny_gpt2(loss_type=loss_type, dropout=0.1), tmp_path, [callback, Spy()]
        )
        trainer.train()
    plain = trainer_for(tiny_gpt2(loss_type=loss_type, dropout=0.1), tmp_path / "plain")
    plain.train()
    assert len(callback.reports) == 1
    assert seen == {0: True, 1: False, 2: False}  # nothing left after the audited update
    assert same_weights(weights(trainer.model), weights(plain.model))
    assert trainer.state.global_step == plain.state.global_step == 3


def test_a_subclass_training_step_is_the_one_audited(tmp_path):
    calls = []

    class Counting(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            calls.append(self.state.global_step)
            return super().training_step(model, inputs, num_items_in_batch)

    callback = AuditCallback(steps=1)
    trainer_for(
        tiny_gpt2(loss_type="ForCausalLM"), tmp_path, [callback], max_steps=2, cls=Counting
    ).train()
    assert calls == [0] * A + [1] * A and callback.reports[0].ok


def test_each_train_call_audits_its_first_steps_and_a_short_run_cleans_up(tmp_path):
    callback = AuditCallback(steps=5)
    trainer = trainer_for(tiny_gpt2(loss_type="ForCausalLM"), tmp_path, [callback], max_steps=2)
    trainer.train()
    assert len(callback.reports) == 2 and "training_step" not in vars(trainer)
    trainer.train()
    assert len(callback.reports) == 2  # the second call's own two updates


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps"),
        ({"steps": True}, "steps"),
        ({"steps": 1.5}, "steps"),
        ({"on_mistake": "ignore"}, "on_mistake"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AuditCallback(**kwargs)


def test_outside_a_trainer_it_says_how_to_use_it():
    callback = AuditCallback()
    with pytest.raises(RuntimeError, match="callbacks=\\[AuditCallback\\(\\)\\]"):
        callback.on_train_begin(None, None, None)


class Regression(torch.nn.Module):
    """A model the audit has no reference objective for: float labels, an MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x, labels=None):
        prediction = self.linear(x).squeeze(-1)
        loss = None if labels is None else torch.nn.functional.mse_loss(prediction, labels)
        return {"loss": loss, "logits": prediction}


@pytest.mark.parametrize(("m", "a"), [(M, A), (1, A), (1, 1)])
def test_a_loss_it_does_not_know_is_checked_by_split_invariance_or_not_checked(tmp_path, m, a):
    """A regression (float labels): no objective the audit knows. The run's own window is
    joined into one microbatch, (m·A, 1), the reference, against the configured split, one
    example per microbatch where m >= 2, and a short window (a mean per microbatch of
    equal sizes, divided by A: invariant, ok); a window of one microbatch of one example
    cannot be split otherwise: a warning says so, never an error or an ok."""
    g = torch.Generator().manual_seed(0)
    rows = [
        {"x": torch.randn(3, generator=g), "labels": torch.randn((), generator=g)}
        for _ in range(M * A)
    ]
    callback = AuditCallback(on_mistake="raise")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=m,
        gradient_accumulation_steps=a,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(model=Regression(), args=args, train_dataset=rows, callbacks=[callback])
    trainer.remove_callback(PrinterCallback)
    if m * a > 1:
        trainer.train()
        (report,) = callback.reports
        assert report.ok and report.invariance, str(report)
        expected = (["(2, 4)", "(1, 8)"] if m > 1 else ["(1, 4)"]) + [f"({m},) A={a}"]  # and the short window
        assert [s.split.label for s in report.invariance[0].splits] == expected
        return
    with pytest.warns(AccumulationWarning, match="not checked: the labels are floating point"):
        trainer.train()
    (report,) = callback.reports
    assert not report.ok and not report.checked and "cannot be split otherwise" in report.reason
    assert trainer.state.global_step == 1  # the run went on


@pytest.mark.distributed
@pytest.mark.slow  # two gloo ranks, three runs each: about 30 s
def test_two_gloo_ranks_agree_and_raise_together():
    """Under DDP (2 gloo ranks, each with its own examples) every rank gets the same
    verdict on its first update, a wrong job warns on both and ``"raise"`` stops both
    before the first update; after the audited update the run is bit for bit the run
    without the callback on both ranks."""
    from helpers import hf_callback_workers

    from accumlab import distributed as ald

    ranks = ald.launch(hf_callback_workers.callback_ranks, 2, timeout_s=60, deadline_s=400)
    for rank in ranks:
        good, bad = rank["loss_type"], rank["plain"]
        assert good["ok"] and good["warned"] == 0 and good["ranks"] == 2, good["text"]
        assert bad["mistakes"] == ["count_before_shift"] and bad["warned"] == 1
        for run in (good, bad):
            assert run["same_as_plain"] and not run["wrapped_after"]
        assert rank["raise"] == {"raised": True, "untouched": True, "updates": 0}
    assert ranks[0]["plain"]["text"] == ranks[1]["plain"]["text"]
    assert ranks[0]["loss_type"]["text"] == ranks[1]["loss_type"]["text"]


@pytest.mark.slow
def test_the_callback_under_transformers_4_57():
    """The same callback under transformers 4.57.6 (whose Trainer counts labels before the
    shift for every model), in a subprocess that imports it from its own folder (``make
    slow`` installs it; the test fails when it is not there)."""
    import json
    import subprocess
    import sys

    from helpers import hf_releases

    env = hf_releases.subprocess_env(hf_releases.release_of("4.57"))
    done = subprocess.run(
        [sys.executable, "-m", "helpers.hf_callback_workers"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"] == "4.57.6"
    masked, every = result["masked"], result["every_token"]
    assert masked["ok"] and masked["warned"] == 0
    assert every["mistakes"] == ["count_before_shift"] and every["warned"] == 1
    for run in (masked, every):
        assert run["same_as_plain"] and not run["wrapped_after"]
    assert result["raise"] == {"raised": True, "untouched": True, "updates": 0}


def test_gradient_checkpointing_is_audited_inside_the_run(tmp_path):
    """The Trainer turns gradient checkpointing on inside train(); the callback runs there,
    on the checkpointed path: a correct job with dropout is ok, a wrong one named, and both
    runs stay bit-identical to runs without the callback."""
    for loss_type, mistakes in (("ForCausalLM", []), (None, ["count_before_shift"])):
        callback = AuditCallback()
        trainer = trainer_for(
            tiny_gpt2(loss_type=loss_type, dropout=0.1),
            tmp_path,
            [callback],
            max_steps=2,
            gradient_checkpointing=True,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        assert trainer.model.is_gradient_checkpointing
        (report,) = callback.reports
        assert report.checked and report.mistakes == mistakes, str(report)
        plain = trainer_for(
            tiny_gpt2(loss_type=loss_type, dropout=0.1),
            tmp_path / "plain",
            max_steps=2,
            gradient_checkpointing=True,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.utils.checkpoint's notes, as above
            plain.train()
        assert same_weights(weights(trainer.model), weights(plain.model))
