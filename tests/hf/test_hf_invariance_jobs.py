"""Trainer subclasses with their own loss, checked by split invariance.

TRL's DPO (sigmoid, hinge, ipo, and ``loss_type=["sigmoid", "sft"]``), KTO, ORPO and CPO
(``trl.experimental``) and ``RewardTrainer``, and a distillation ``Trainer`` written here in
three forms (``tests/helpers/hf_jobs.py``): the common form with each microbatch's own
means, the correct form (token sums over ``num_items_in_batch``), and the correct form
divided by A once more. Before, every TRL job was "not checked: the batches' labels are a
NoneType" and every distillation form was called ``not_token_mean`` (the correct one too,
with a scale of 0.498).

The truth is measured without the audit: the same 8 examples trained for one real update
(SGD at learning rate 1, read off the weights) at (m, A) = (2, 4) and at (8, 1); a loss
whose window is one sum divided once gives the same update at both. The audit must be ok
exactly for the jobs whose real updates agree, name the others, and report the factor the
real updates show.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

from helpers import hf_jobs as hj  # noqa: E402

import accumlab.hf as ah  # noqa: E402

transformers.logging.set_verbosity_error()

#: job -> the names the audit gives it (empty: ok)
VERDICTS = {
    "dpo_sigmoid": [],
    "dpo_hinge": [],
    "dpo_ipo": [],
    "dpo_sigmoid_sft": ["average_of_averages"],  # the SFT term is a mean per microbatch, / A
    "kto": ["average_of_averages"],  # each microbatch's own loss (z0 its own statistic), / A
    "orpo": ["average_of_averages"],  # its NLL term is a token mean per microbatch, / A
    "cpo": ["average_of_averages"],
    "reward": [],
    "distill_blog": ["num_items_ignored"],  # per-microbatch means, not divided by A: ~ x A
    "distill_sums": [],
    "distill_twice": ["double_division"],
}

#: jobs whose real updates at (2, 4) and (8, 1) are measured (each is two trainings)
TRUTH = ("dpo_sigmoid", "dpo_sigmoid_sft", "distill_blog", "distill_sums", "distill_twice")

JOBS = hj.invariance_jobs()
TOL = 1e-5  # float32 rounding between two splits of a tiny model


def real_factor(build):
    """(factor, relative error) of the real update at (2, 4) against the one at (8, 1)."""
    configured, _ = hj.applied(build(**hj.SGD))
    whole, _ = hj.applied(build(**{**hj.SGD, "per_device_train_batch_size": hj.M * hj.A,
                                   "gradient_accumulation_steps": 1}))
    return hj.compare(configured, whole)


@pytest.mark.parametrize("name", [n if n.startswith("distill") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in VERDICTS])  # the TRL jobs in the slow tier
def test_split_invariance_names_what_the_real_updates_show(name):
    report = ah.audit_trainer(JOBS[name](**hj.SGD))
    assert report.checked, str(report)
    assert report.invariance and "checked by split invariance" in report.objective, str(report)
    assert report.mistakes == VERDICTS[name], str(report)
    assert report.ok is (not VERDICTS[name])
    (checked,) = report.invariance
    splits = {m.split.label: m for m in checked.splits if m.kind == "split"}
    assert f"(1, {hj.M * hj.A})" in splits, str(report)  # one example per microbatch always runs
    own = checked.own  # the configured split against the window as one microbatch
    if name in ("orpo", "cpo"):  # left-padded prompts: the window cannot run as one microbatch
        assert checked.reference == checked.configured and own is None, str(report)
        assert any("cannot be joined" in n for n in report.notes), report.notes
        decisive = [m for m in checked.splits if m.kind == "split"]  # (1, 8) against (2, 4)
        assert max(m.relative_error for m in decisive) > TOL
    else:
        assert checked.reference.label == f"({hj.M * hj.A}, 1)", str(report)
        assert (own.relative_error <= TOL) is report.ok, str(report)
    for m in checked.splits:
        assert m.line() in str(report)
    if name in TRUTH:
        true_factor, true_error = real_factor(JOBS[name])
        assert (true_error <= TOL) is report.ok, (true_factor, true_error)
        assert own.factor == pytest.approx(true_factor, rel=1e-4), str(report)
        assert own.relative_error == pytest.approx(true_error, rel=1e-3, abs=TOL)
    if report.ok:
        assert report.fix == ""
    else:
        assert "num_items_in_batch" in report.fix or "/ A" in report.fix, report.fix
        assert "not checked" in str(report)


def test_the_ratios_a_wrong_division_gives_are_named_as_such():
    """The distillation job divided by A twice is exactly 1/A times right at (2, 4) against
    (8, 1), and 1/8 at (1, 8) (the gradient shrinks as A grows); the common form,
    per-microbatch means summed with no division by A, is about A times."""
    twice = ah.audit_trainer(JOBS["distill_twice"](**hj.SGD))
    factors = {m.split.label: m.factor for m in twice.invariance[0].splits if m.kind == "split"}
    assert factors[f"({hj.M}, {hj.A})"] == pytest.approx(1 / hj.A, rel=1e-5)
    assert factors[f"(1, {hj.M * hj.A})"] == pytest.approx(1 / (hj.M * hj.A), rel=1e-5)
    assert "one division by A too many" in twice.evidence["double_division"]
    blog = ah.audit_trainer(JOBS["distill_blog"](**hj.SGD))
    assert 2.0 < blog.invariance[0].own.factor < 2.0 * hj.A, str(blog)


def test_the_callback_checks_a_subclass_in_a_real_run(tmp_path):
    """AuditCallback on the common distillation form: the run's own first window, split
    invariance, the same name as audit_trainer, and the run goes on."""
    from accumlab.hf.callback import AuditCallback

    callback = AuditCallback()
    trainer = JOBS["distill_blog"](**hj.SGD)
    trainer.add_callback(callback)
    with pytest.warns(Warning, match="num_items_ignored"):
        trainer.train()
    (report,) = callback.reports
    assert report.invariance and report.mistakes == ["num_items_ignored"], str(report)
    assert trainer.state.global_step == 1
