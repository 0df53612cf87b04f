"""accumlab.testing: the test a team keeps, run by pytest itself (pytester) on two jobs, one
that passes and one that fails with the report's text."""

from __future__ import annotations

import pytest
import torch
from helpers import invariance_jobs as jobs

from accumlab.invariance import InvarianceReport, Split
from accumlab.testing import assert_checked_ok, assert_split_invariant, assert_token_mean

pytest_plugins = ["pytester"]

#: A team's test file: its model, data, collate and window code, and two tests.
TEAM_TESTS = '''
import torch
import torch.nn.functional as F
from accumlab.loop_audit.controlled_set import AuditLM
from accumlab.testing import assert_split_invariant

def examples():
    lengths = [3, 9, 4, 7, 5, 8, 3, 6]
    return [{"ids": [(3 * i + j) % 13 for j in range(n)]} for i, n in enumerate(lengths)]

def collate(items):
    width = max(len(e["ids"]) for e in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for r, e in enumerate(items):
        ids[r, :len(e["ids"])] = torch.tensor(e["ids"])
        labels[r, :len(e["ids"])] = torch.tensor(e["ids"])
    return {"input_ids": ids, "labels": labels}

def model():
    torch.manual_seed(0)
    return AuditLM().double()

def token_sum(model, microbatches, accumulation_steps):
    total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in microbatches)
    for mb in microbatches:
        logits = model(input_ids=mb["input_ids"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                               ignore_index=-100, reduction="sum")
        (loss / total).backward()

def mean_over_a(model, microbatches, accumulation_steps):
    for mb in microbatches:
        (model(**mb).loss / accumulation_steps).backward()

def test_token_sum_does_not_depend_on_the_split():
    assert_split_invariant(model(), examples(), collate, token_sum,
                           micro_batch_size=2, accumulation_steps=4)

def test_mean_over_a_does_not_depend_on_the_split():
    assert_split_invariant(model(), examples(), collate, mean_over_a,
                           micro_batch_size=2, accumulation_steps=4)
'''


def test_a_team_test_passes_on_a_correct_job_and_fails_on_a_wrong_one_with_the_report(pytester):
    pytester.makepyfile(test_team=TEAM_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "test_mean_over_a_does_not_depend_on_the_split" in text
    result.stdout.fnmatch_lines([
        "*AssertionError: split invariance: not ok: average_of_averages, short_window_divided_by_a*",
        "*(2, 4) = * x (8, 1): relative error*",
        "*- average_of_averages*",
        "*fix: sum the token losses*",
    ])
    # the helper's own frame is hidden: the failure points at the team's line
    assert "__tracebackhide__" not in text


@pytest.fixture(scope="module")
def model():
    return jobs.make_model()


@pytest.fixture(scope="module")
def examples():
    return jobs.make_examples(8)


def test_the_helpers_return_the_report_when_ok_and_raise_its_text_when_not(model, examples):
    kwargs = dict(micro_batch_size=2, accumulation_steps=4)
    report = assert_token_mean(model, examples, jobs.collate, jobs.token_sum, **kwargs)
    assert isinstance(report, InvarianceReport) and report.ok
    assert report.measure(Split.uniform(2, 4), "objective") is not None
    with pytest.raises(AssertionError) as info:
        assert_split_invariant(model, examples, jobs.collate, jobs.window_mean_over_a, **kwargs)
    assert str(info.value).startswith("split invariance: not ok: double_division")

    def halved(model, microbatches, accumulation_steps):  # invariant, but not the token mean
        jobs.token_sum(model, microbatches, accumulation_steps)
        for p in model.parameters():
            p.grad.mul_(0.5)

    assert assert_split_invariant(model, examples, jobs.collate, halved, **kwargs).ok
    with pytest.raises(AssertionError, match="not ok: wrong_normalization"):
        assert_token_mean(model, examples, jobs.collate, halved, **kwargs)


def test_a_check_that_did_not_run_is_no_pass(model, examples):
    def dropout(model, microbatches, accumulation_steps):
        for mb in microbatches:
            torch.nn.functional.dropout(model(**mb).loss, 0.5).backward()

    with pytest.raises(AssertionError, match="split invariance: not checked: the window at"):
        assert_split_invariant(model, examples, jobs.collate, dropout, micro_batch_size=2,
                               accumulation_steps=4)
    with pytest.raises(AssertionError, match="the check never ran"):
        assert_checked_ok(None)
