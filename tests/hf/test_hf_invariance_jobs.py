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
    "dpo_sigmoid_sft": ["depends_on_split"],  # the SFT term is a mean per microbatch
    "kto": ["depends_on_split"],  # the KL estimate z0 is a statistic of each microbatch
    "orpo": ["depends_on_split"],
    "cpo": ["depends_on_split"],
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


@pytest.mark.parametrize("name", list(VERDICTS))
def test_split_invariance_names_what_the_real_updates_show(name):
    report = ah.audit_trainer(JOBS[name](**hj.SGD))
    assert report.checked, str(report)
    assert report.invariance and "checked by split invariance" in report.objective, str(report)
    assert report.mistakes == VERDICTS[name], str(report)
    assert report.ok is (not VERDICTS[name])
    splits = {(s.micro_batch_size, s.accumulation_steps): s for r in report.invariance for s in r.splits}
    assert (1, hj.M * hj.A) in splits, str(report)  # the finer split always runs
    for s in splits.values():
        assert (s.relative_error <= TOL) is report.ok, str(report)
        assert f"{s.factor:.4f}" in str(report)
    if name in TRUTH:
        assert (hj.M * hj.A, 1) in splits, str(report)
        true_factor, true_error = real_factor(JOBS[name])
        assert (true_error <= TOL) is report.ok, (true_factor, true_error)
        measured = splits[(hj.M * hj.A, 1)]
        assert measured.factor == pytest.approx(true_factor, rel=1e-4), str(report)
        assert measured.relative_error == pytest.approx(true_error, rel=1e-3, abs=TOL)
    if report.ok:
        assert report.fix == ""
    else:
        assert "num_items_in_batch" in report.fix or "/ A" in report.fix, report.fix
        assert "not checked" in str(report)


def test_the_ratios_a_wrong_division_gives_are_named_as_such():
    """The distillation job divided by A twice is exactly 1/A times right at (2, 4) against
    (8, 1), and 2 times its (1, 8) gradient (A doubles, the extra division halves); the
    common form, per-microbatch means summed with no division by A, is about A times."""
    twice = ah.audit_trainer(JOBS["distill_twice"](**hj.SGD))
    factors = {(s.micro_batch_size, s.accumulation_steps): s.factor for r in twice.invariance for s in r.splits}
    assert factors[(hj.M * hj.A, 1)] == pytest.approx(1 / hj.A, rel=1e-5)
    assert factors[(1, hj.M * hj.A)] == pytest.approx(2.0, rel=1e-5)
    assert "one division by A too many" in twice.evidence["double_division"]
    blog = ah.audit_trainer(JOBS["distill_blog"](**hj.SGD))
    whole = next(s for r in blog.invariance for s in r.splits if s.accumulation_steps == 1)
    assert 2.0 < whole.factor < 2.0 * hj.A, str(blog)


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
