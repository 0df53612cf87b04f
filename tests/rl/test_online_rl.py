"""Online RL by split invariance on the generated buffer: TRL's GRPO and RLOO.

The job is the issue's: a tiny Llama from its config, a character tokenizer made in
code, 2 prompts x 4 generations, completions of 0 to 11 characters, ``beta=0``, one
iteration (``tests/helpers/hf_rl.py``). Its truth is measured without the audit: the real
first update read off the weights (SGD at learning rate 1) at (m, A) = (2, 4) against the
one at (8, 1), the completions checked identical (the same generation batch at both).

The audit captures what the trainer accumulates for the window (each microbatch's
generated slice: prompts, completions, masks, advantages, the count), freezes it, and
replays the trainer's own ``compute_loss`` at other splits of that buffer with its own
normalizers. bnpo (each microbatch's token mean, divided by A) is named; dapo, grpo,
dr_grpo and RLOO are ok; TRL's DAPO normalizer before its PR #6024, put back by a
monkeypatch with ``steps_per_generation=4`` and A = 2, is the double division it is, at
scale 0.5 (the real update of the patched job is 0.5 times TRL's own, read off the
weights).
"""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

from helpers import hf_jobs as hj  # noqa: E402
from helpers import hf_rl  # noqa: E402

import accumlab.hf as ah  # noqa: E402
from accumlab.hf.callback import AccumulationWarning, AuditCallback  # noqa: E402

transformers.logging.set_verbosity_error()
TOL = 1e-5
WHOLE = {"m": 8, "a": 1}

#: (trainer, loss_type) -> the names the audit gives (the truth decides ok below)
LOSSES = {
    ("grpo", "bnpo"): ["average_of_averages"],  # TRL: "may slightly vary"; it is 1/A of the sum
    ("grpo", "dapo"): [],
    ("grpo", "grpo"): [],
    ("grpo", "dr_grpo"): [],
    ("rloo", None): [],
}
FAST = (("grpo", "bnpo"), ("grpo", "dapo"))  # the rest in the slow tier


def _case(key):
    marks = () if key in FAST else (pytest.mark.slow,)
    return pytest.param(key, marks=marks, id="-".join(k for k in key if k))


@pytest.fixture(scope="module")
def truths():
    """(loss) -> (factor, relative error) of the real update at (2, 4) against (8, 1)."""
    cache = {}

    def truth(key):
        if key not in cache:
            kind, loss = key
            g, seen = hf_rl.real_update(hf_rl.build(kind, loss, **hj.SGD))
            whole, seen_whole = hf_rl.real_update(hf_rl.build(kind, loss, **WHOLE, **hj.SGD))
            assert seen == seen_whole  # the same completions at both splits
            assert min(map(len, seen)) < max(map(len, seen)) <= 11  # of uneven length
            cache[key] = hj.compare(g, whole)
        return cache[key]

    return truth


@pytest.mark.parametrize("key", [_case(k) for k in LOSSES])
def test_each_loss_is_named_as_its_real_updates_show(truths, key):
    true_factor, true_error = truths(key)
    report = ah.audit_trainer(hf_rl.build(*key, **hj.SGD))
    assert report.checked and report.invariance, str(report)
    assert report.mistakes == LOSSES[key] and report.ok is (true_error < TOL), (true_error, str(report))
    (checked,) = report.invariance
    own = checked.own  # (2, 4) against the buffer's 8 completions as one microbatch
    assert (own.split.label, checked.reference.label) == ("(2, 4)", "(8, 1)")
    assert own.factor == pytest.approx(true_factor, rel=1e-4), str(report)
    assert own.relative_error == pytest.approx(true_error, rel=1e-3, abs=TOL)


def test_the_dapo_normalizer_before_trl_6024_is_a_double_division():
    """steps_per_generation = 4, A = 2: each microbatch divided by the generation batch's
    count (two windows of it), where TRL's fix divides by this window's share."""
    setting = {"a": 2, "steps_per_generation": 4, **hj.SGD}
    fixed, seen = hf_rl.real_update(hf_rl.build("grpo", "dapo", **setting))
    before, seen_before = hf_rl.real_update(hf_rl.before_6024(hf_rl.build("grpo", "dapo", **setting)))
    assert seen == seen_before
    assert hj.compare(before, fixed)[0] == pytest.approx(0.5, rel=1e-6)  # the truth
    report = ah.audit_trainer(hf_rl.before_6024(hf_rl.build("grpo", "dapo", **setting)))
    assert report.mistakes == ["double_division"], str(report)
    assert report.invariance[0].own.factor == pytest.approx(0.5, rel=1e-5)
    assert "steps_per_generation = 2/4" in report.evidence["double_division"]
    right = ah.audit_trainer(hf_rl.build("grpo", "dapo", **setting))
    assert right.ok, str(right)


def test_the_callback_checks_the_generated_buffer_of_a_real_run():
    """AuditCallback on GRPO in a real run: bnpo warns with the same name, dapo says
    nothing; the weights equal the run's without the callback, bit for bit."""
    for loss, names in (("bnpo", ["average_of_averages"]), ("dapo", [])):
        callback = AuditCallback()
        trainer = hf_rl.build("grpo", loss, **{**hj.SGD, "max_steps": 2})
        trainer.add_callback(callback)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        plain = hf_rl.build("grpo", loss, **{**hj.SGD, "max_steps": 2})
        plain.train()
        (report,) = callback.reports
        assert report.mistakes == names, str(report)
        said = [w for w in caught if issubclass(w.category, AccumulationWarning)]
        assert bool(said) is bool(names)
        for a, b in zip(trainer.model.parameters(), plain.model.parameters(), strict=True):
            assert a.detach().equal(b.detach())
