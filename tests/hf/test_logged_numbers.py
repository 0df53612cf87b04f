"""The numbers the Trainer logs for the audited window, judged apart from the update.

Each job's truth is measured without the audit: one real update at SGD learning rate 1
(the gradient read off the weights), the Trainer's own log of that update
(``logging_steps=1``: its ``loss`` and ``grad_norm``), and the window's objective
written by hand (the token mean of the 8 examples' shifted cross-entropy). The audit
must predict the numbers the Trainer logs and name a wrong one apart from a right update,
and a right one beside a wrong update. Before, neither audit looked at a logged number.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import hf_workers as hw  # noqa: E402

import accumlab.hf as ah  # noqa: E402

transformers.logging.set_verbosity_error()
A = 4


class LogsTimesA(transformers.Trainer):
    """Trains right, logs A times the loss (the form of the logging bugs users report:
    'the loss at A = 8 is 8 times the loss at A = 1')."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch) * self.args.gradient_accumulation_steps


class BackwardTimesA(transformers.Trainer):
    """Logs the right loss, applies A times its gradient (a scale left in the backward)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self.accelerator.backward(loss * self.args.gradient_accumulation_steps)
        return loss.detach()


class NormTimesA(transformers.Trainer):
    """Trains right, reports A times the gradient norm (as when a norm is taken before a
    division by A that the update then applies)."""

    def _get_grad_norm(self, model, grad_norm=None):
        return super()._get_grad_norm(model, grad_norm) * self.args.gradient_accumulation_steps


def objective(model: torch.nn.Module) -> float:
    """The window's objective at ``model``'s weights: the token mean of the 8 examples."""
    batch = hw.collate(hw.examples())
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return float(hw.shifted_sum(logits, batch["labels"]) / int((batch["labels"][:, 1:] != -100).sum()))


@pytest.fixture(scope="module", params=[None, LogsTimesA, BackwardTimesA, NormTimesA],
                ids=["right", "logs_times_A", "backward_times_A", "norm_times_A"])
def job(request):
    """(trainer class, the truth: the real update's relative error against the reference,
    the logged numbers, the objective, the norm of the real update, the audit's report)."""
    cls = request.param
    g, logged = hw.applied_and_logged(hw.model_for("loss_type"), trainer_class=cls)
    ref = hw.reference_gradient(hw.model_for("loss_type"), [hw.collate(hw.examples())])
    truth = {"error": float((g - ref).norm() / ref.norm()), "logged": logged,
             "objective": objective(hw.model_for("loss_type")), "norm": float(g.norm())}
    report = ah.audit_trainer(hw.make_trainer(hw.model_for("loss_type"), trainer_class=cls))
    return cls, truth, report


def test_the_audit_predicts_what_the_trainer_logs(job):
    _, truth, report = job
    found = {n.name: n for n in report.logged}
    assert found.keys() == {"loss", "grad_norm"}, str(report)
    assert found["loss"].logged == pytest.approx(truth["logged"]["loss"], rel=1e-3)
    assert found["grad_norm"].logged == pytest.approx(truth["logged"]["grad_norm"], rel=1e-3)
    assert found["loss"].expected == pytest.approx(truth["objective"], rel=1e-5)
    assert found["grad_norm"].expected == pytest.approx(truth["norm"], rel=1e-5)  # the update's own


def test_a_wrong_logged_number_is_named_apart_from_the_update(job):
    cls, truth, report = job
    found = {n.name: n for n in report.logged}
    update_right = truth["error"] < 1e-5
    assert report.ok is update_right, str(report)
    wrong_loss = truth["logged"]["loss"] / truth["objective"]
    wrong_norm = truth["logged"]["grad_norm"] / truth["norm"]
    if cls is LogsTimesA:  # the truth: update right, log x A
        assert update_right and wrong_loss == pytest.approx(A, rel=1e-3)
        assert (found["loss"].finding, found["loss"].apart) == ("x A", True)
        assert str(report).startswith("accumulation audit: update ok; logged loss x A")
    elif cls is NormTimesA:
        assert update_right and wrong_norm == pytest.approx(A, rel=1e-3)
        assert (found["grad_norm"].finding, found["grad_norm"].apart) == ("x A", True)
        assert str(report).startswith("accumulation audit: update ok; logged grad_norm x A")
    elif cls is BackwardTimesA:  # the truth: update x A, log right
        assert not update_right and wrong_loss == pytest.approx(1, rel=1e-3)
        assert report.mistakes and found["loss"].finding == "right", str(report)
        assert found["grad_norm"].finding == "as the update"  # the norm of the update it applies
    else:
        assert update_right and report.logged_ok and all(n.finding == "right" for n in report.logged)
    assert report.logged_ok is (cls in (None, BackwardTimesA))
