"""al.split_invariance on jobs users write (plain PyTorch, Accelerate's documented loops,
torchtune's and torchtitan's steps), each verdict checked against the truth measured
without the engine: the real update of one SGD step (lr 1, float64) read off the weights
at each split, and the token mean computed one example at a time."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import invariance_jobs as jobs

import accumlab as al

M, A = 2, 4
N = M * A
SPLITS = {"reference": ((N,), 1), "configured": ((M,) * A, A), "finest": ((1,) * N, N)}


@pytest.fixture(scope="module")
def model():
    return jobs.make_model()


@pytest.fixture(scope="module")
def examples():
    return jobs.make_examples(N + 1)  # one more than the window: reported as unused


@pytest.fixture(scope="module")
def accelerator():
    accelerate = pytest.importorskip("accelerate")
    return accelerate.Accelerator(cpu=True)


def check(model, examples, window):
    return al.split_invariance(model, examples, jobs.collate, window, micro_batch_size=M,
                               accumulation_steps=A, objective=al.NextTokenLoss())


def truth(model, examples, window):
    """The real updates at each split and the short window, and the token mean."""
    window_examples = examples[:N]
    out = {k: jobs.real_update(model, window_examples, window, *v) for k, v in SPLITS.items()}
    out["short"] = jobs.real_update(model, window_examples, window, (M,), A)
    out["short_full"] = jobs.real_update(model, window_examples, window, (M,), 1)
    out["token_mean"] = jobs.token_mean_gradient(model, window_examples)
    return out


def assert_measures_match_truth(report, t):
    """Every factor and error the report gives is the one the real updates give."""
    pairs = [
        (al.Split.uniform(M, A), "split", t["configured"], t["reference"]),
        (al.Split((1,) * N, N), "split", t["finest"], t["reference"]),
        (al.Split((M,), A), "short", t["short"], t["short_full"]),
        (al.Split.uniform(M, A), "objective", t["configured"], t["token_mean"]),
    ]
    for split, kind, update, against in pairs:
        m = report.measure(split, kind)
        assert m is not None, (split, kind)
        assert m.relative_error == pytest.approx(jobs.relative_error(update, against), rel=1e-6, abs=1e-12)
        assert m.factor == pytest.approx(jobs.factor(update, against), rel=1e-9)


CASES = {
    "token_sum": (jobs.token_sum, []),
    "torchtitan_style": (jobs.torchtitan_style, []),
    "mean_over_a": (jobs.mean_over_a, ["average_of_averages", "short_window_divided_by_a"]),
    "window_mean_over_a": (jobs.window_mean_over_a, ["double_division"]),
    "means_summed": (jobs.means_summed, ["sum_of_means"]),
    "torchtune_style": (jobs.torchtune_style, ["depends_on_split"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_job_gets_the_verdict_its_real_updates_give(model, examples, name):
    window, expected = CASES[name]
    report = check(model, examples, window)
    t = truth(model, examples, window)
    assert report.mistakes == expected, report.text()
    assert report.ok == (not expected)
    assert_measures_match_truth(report, t)
    invariant = jobs.relative_error(t["configured"], t["reference"]) < 1e-12
    assert invariant == ("depends_on_split" not in expected and "average_of_averages" not in expected
                         and "double_division" not in expected and "sum_of_means" not in expected)
    if report.ok:  # ok only where the real update is the token mean
        assert jobs.relative_error(t["configured"], t["token_mean"]) < 1e-12
    assert report.notes == ["1 example beyond the window's 8 were not used"]


def test_accelerate_documented_loops(model, examples, accelerator):
    mean_loss, token_mean = jobs.accelerate_jobs(accelerator)
    report = check(model, examples, token_mean)
    assert report.ok, report.text()
    assert_measures_match_truth(report, truth(model, examples, token_mean))
    report = check(model, examples, mean_loss)
    assert report.mistakes == ["average_of_averages", "short_window_divided_by_a"], report.text()
    t = truth(model, examples, mean_loss)
    assert_measures_match_truth(report, t)
    assert jobs.factor(t["short"], t["short_full"]) == pytest.approx(1 / A)


def test_the_model_its_gradients_and_the_random_state_are_as_before(model, examples):
    grads = []
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
        grads.append(p.grad)
    before = [p.detach().clone() for p in model.parameters()]
    random.seed(3)
    torch.manual_seed(3)
    state = (random.getstate(), torch.get_rng_state())
    check(model, examples, jobs.mean_over_a)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(g, torch.full_like(g, 7.0)) for g in grads)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[1])
    for p in model.parameters():
        p.grad = None


def test_dropout_and_a_step_are_refused_in_one_line(examples):
    model = jobs.make_model()
    model.drop = torch.nn.Dropout(0.1)

    def with_dropout(model, microbatches, accumulation_steps):
        for mb in microbatches:
            logits = model(input_ids=mb["input_ids"]).logits
            model.drop(logits).sum().backward()

    report = check(model, examples, with_dropout)
    assert not report.checked
    assert report.reason.startswith("the window at (8, 1) drew random numbers (torch's CPU generator moved")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def steps(model, microbatches, accumulation_steps):
        jobs.token_sum(model, microbatches, accumulation_steps)
        optimizer.step()

    report = check(model, examples, steps)
    assert not report.checked and "wrote into" in report.reason and "(an optimizer step?)" in report.reason


def test_bad_arguments_are_named(model, examples):
    def call(**changes):
        kwargs = dict(model=model, examples=examples, collate=jobs.collate, window=jobs.token_sum,
                      micro_batch_size=M, accumulation_steps=A)
        kwargs.update(changes)
        return al.split_invariance(**kwargs)

    with pytest.raises(ValueError, match="examples holds 9 examples; .* needs 10"):
        call(micro_batch_size=5, accumulation_steps=2)
    with pytest.raises(TypeError, match="window must accept three arguments"):
        call(window=lambda model, microbatches: None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        call(model="gpt2")
    with pytest.raises(TypeError, match="micro_batch_size must be an int"):
        call(micro_batch_size=2.0)
    with pytest.raises(TypeError, match="objective must be an accumlab Objective"):
        call(objective="token_mean")

    def broken(model, microbatches, accumulation_steps):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        call(window=broken)
    if sys.version_info >= (3, 11):  # exceptions carry notes from 3.11
        assert "(raised by the window code at split (8, 1))" in info.value.__notes__


def test_the_docs_example_runs_as_printed(capsys):
    """docs/AUDIT.md's split-invariance section: its python block, run as it stands, prints
    the text block below it."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "AUDIT.md").read_text(encoding="utf-8")
    section = doc.partition("\n## Split invariance on your own job")[2].partition("\n## ")[0]
    code = re.search(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    printed = re.search(r"^```text\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert code and printed, "the section has a python block and a text block"
    exec(compile(code.group(1), "docs/AUDIT.md", "exec"), {})
    assert capsys.readouterr().out == printed.group(1)


def test_a_zero_gradient_a_hidden_weight_write_and_a_deepspeed_engine_are_not_checked(model, examples):
    """What would give a false ok (nothing in .grad: every split equal) or a false verdict
    (weights moved under the check) is refused in one line."""

    def no_backward(model, microbatches, accumulation_steps):
        for mb in microbatches:
            model(**mb)

    report = check(model, examples, no_backward)
    assert not report.checked and report.reason.startswith("the gradient at (8, 1) is zero")

    def steps_through_data(model, microbatches, accumulation_steps):
        jobs.token_sum(model, microbatches, accumulation_steps)
        with torch.no_grad():
            for p in model.parameters():
                p.data.sub_(p.grad)  # no version counter sees a write through .data

    fresh = jobs.make_model()
    report = check(fresh, examples, steps_through_data)
    assert not report.checked and "wrote into" in report.reason

    class DeepSpeedEngine(torch.nn.Module):  # the class accelerator.prepare returns, by module
        def __init__(self, module):
            super().__init__()
            self.module = module

    DeepSpeedEngine.__module__ = "deepspeed.runtime.engine"
    report = check(DeepSpeedEngine(model), examples, jobs.token_sum)
    assert not report.checked
    assert report.reason.startswith("a DeepSpeed engine owns the gradient: its backward steps")
