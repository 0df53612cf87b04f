"""The split-invariance engine (accumlab.invariance) on jobs written as formulas: each
example ``i`` has a loss-sum gradient ``s_i`` and ``t_i`` targets, and a job's gradient at
a split is what its normalization makes of them. The expected factors are worked out here
from the formulas, not read from the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from accumlab.invariance import (
    HeldGradient,
    NotChecked,
    Split,
    check_splits,
    default_splits,
)
from accumlab.mistakes import MISTAKES, reported_by

N_PARAMS = (3, 5)  # two "parameters" of 3 and 5 entries
TARGETS = [3, 7, 2, 9, 4, 4, 1, 6]  # uneven: a mean per microbatch is not the token mean


def _vectors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(sum(N_PARAMS), generator=g, dtype=torch.float64) for _ in TARGETS]


S = _vectors()


def as_gradient(v: torch.Tensor) -> list[torch.Tensor]:
    return list(v.split(N_PARAMS))


def job(weight):
    """``run(split)`` where microbatch ``j`` of the split contributes ``Σ s_i × weight(split,
    j_examples)``."""

    def run(split: Split):
        total = torch.zeros(sum(N_PARAMS), dtype=torch.float64)
        window = [i for r in split.ranges() for i in r]
        for r in split.ranges():
            w = weight(split, list(r), window)
            for i in r:
                total += w * S[i]
        return as_gradient(total)

    return run


def t(indices):
    return sum(TARGETS[i] for i in indices)


correct = job(lambda split, mb, window: 1 / t(window))
double = job(lambda split, mb, window: 1 / t(window) / split.accumulation_steps)
mean_over_a = job(lambda split, mb, window: 1 / t(mb) / split.accumulation_steps)
means_summed = job(lambda split, mb, window: 1 / t(mb))
# per microbatch: divided by the window's count, in a job that always divides by the
# configured A and multiplies back by the microbatches it has (a full window: no change)
short_scaled = job(lambda split, mb, window: 1 / t(window) * split.microbatches / split.accumulation_steps)
squared = job(lambda split, mb, window: t(mb) / t(window) ** 2)  # a per-microbatch statistic

CONFIGURED = Split.uniform(2, 4)


def test_split_holds_sizes_and_the_a_it_divides_by():
    s = Split((2,), 4)
    assert s.short and s.microbatches == 1 and s.examples == 2
    assert s.full() == Split((2,), 1)
    assert Split((2, 2, 2, 1), 4).label == "(2, 2, 2, 1) A=4"
    assert Split.uniform(2, 4).label == "(2, 4)"
    assert str(s) == "(2,) A=4"
    assert [list(r) for r in Split((2, 1), 2, start=3).ranges()] == [[3, 4], [5]]
    assert Split((2, 1), 2, start=3).alone() == [Split((2,), 1, 3), Split((1,), 1, 5)]
    with pytest.raises(ValueError, match="accumulation_steps must be an int of at least len"):
        Split((2, 2), 1)
    with pytest.raises(ValueError, match="sizes must be a non-empty tuple"):
        Split((), 1)
    with pytest.raises(ValueError, match="sizes must be a non-empty tuple"):
        Split((2, 0), 2)


def test_the_default_splits_are_the_reference_the_configured_the_finest_and_a_short_window():
    assert default_splits(CONFIGURED) == [
        Split((8,), 1), CONFIGURED, Split((1,) * 8, 8), Split((2,), 4)]
    # m = 1: (1, A) is the finest split; A = 1: the configured split is the reference
    assert default_splits(Split.uniform(1, 3)) == [Split((3,), 1), Split((1,) * 3, 3), Split((1,), 3)]
    assert default_splits(Split.uniform(4, 1)) == [Split((4,), 1), Split((1,) * 4, 4)]
    uneven = Split((2, 2, 2, 1), 4)
    assert default_splits(uneven)[:2] == [Split((7,), 1), uneven]


def test_a_correct_job_is_ok_at_every_split():
    report = check_splits(correct, CONFIGURED)
    assert report.ok and report.checked and report.mistakes == [], report.text()
    assert report.tolerance == 1e-9  # float64 gradients
    assert {m.kind for m in report.measures} == {"split", "short"}
    for m in report.measures:
        assert m.relative_error < 1e-14 and abs(m.factor - 1) < 1e-14
    assert report.text().startswith("split invariance: ok")


def test_a_double_division_is_named_by_its_factor_of_one_over_a():
    report = check_splits(double, CONFIGURED)
    assert report.mistakes == ["double_division"], report.text()
    m = report.measure(CONFIGURED)
    assert abs(m.factor - 1 / 4) < 1e-12 and abs(m.relative_error - 3 / 4) < 1e-12
    assert abs(report.measure(Split((1,) * 8, 8)).factor - 1 / 8) < 1e-12
    # the short window's 1/4 is the same division: not named twice
    assert "short_window_divided_by_a" not in report.mistakes


def test_an_average_of_averages_is_named_by_its_structure():
    report = check_splits(mean_over_a, CONFIGURED)
    assert report.mistakes == ["average_of_averages", "short_window_divided_by_a"], report.text()
    structure = report.measure(CONFIGURED, "structure")
    assert abs(structure.factor - 1 / 4) < 1e-12 and structure.residual < 1e-7
    # the factor against the reference is what the formula gives, worked out here
    truth = sum((1 / t(r) / 4) * S[i] for r in CONFIGURED.ranges() for i in r)
    reference = sum(S[i] / t(range(8)) for i in range(8))
    m = report.measure(CONFIGURED)
    assert abs(m.relative_error - float((truth - reference).norm() / reference.norm())) < 1e-12
    assert abs(m.factor - float(truth.dot(reference) / reference.dot(reference))) < 1e-12
    short = report.measure(Split((2,), 4), "short")
    assert abs(short.factor - 1 / 4) < 1e-12


def test_means_summed_grow_with_a():
    report = check_splits(means_summed, CONFIGURED)
    assert report.mistakes == ["sum_of_means"], report.text()
    assert abs(report.measure(CONFIGURED, "structure").factor - 1) < 1e-12


def test_a_short_window_divided_by_the_configured_a_is_named_alone():
    report = check_splits(short_scaled, CONFIGURED)
    assert report.mistakes == ["short_window_divided_by_a"], report.text()
    assert abs(report.measure(Split((2,), 4), "short").factor - 1 / 4) < 1e-12
    # a short window of 3 microbatches of A = 4: scaled 3/4
    report = check_splits(short_scaled, CONFIGURED, splits=[Split((8,), 1), Split((2, 2, 2), 4)])
    assert report.mistakes == ["short_window_divided_by_a"]
    assert abs(report.measures[0].factor - 3 / 4) < 1e-12


def test_a_dependence_no_factor_explains_depends_on_split():
    report = check_splits(squared, CONFIGURED)
    assert report.mistakes == ["depends_on_split"], report.text()
    assert not report.ok


def test_the_objective_names_a_split_invariant_job_that_is_not_it():
    def objective(split):  # the token mean over the split's examples
        window = [i for r in split.ranges() for i in r]
        return as_gradient(sum(S[i] for i in window) / t(window))

    assert check_splits(correct, CONFIGURED, objective=objective).ok
    halved = job(lambda split, mb, window: 0.5 / t(window))
    report = check_splits(halved, CONFIGURED, objective=objective)
    assert report.mistakes == ["wrong_normalization"], report.text()
    assert abs(report.measure(CONFIGURED, "objective").factor - 0.5) < 1e-12
    squared_window = job(lambda split, mb, window: 1 / t(window) * (1 + (mb[0] % 3)) / 2)
    report = check_splits(squared_window, Split.uniform(1, 8), splits=[Split((1,) * 8, 8)],
                          objective=objective)
    assert report.mistakes == ["not_token_mean"], report.text()


def test_every_name_the_engine_gives_is_a_split_name_of_the_table():
    assert set(reported_by("split")) == {
        "double_division", "average_of_averages", "sum_of_means", "short_window_divided_by_a",
        "wrong_normalization", "not_token_mean", "depends_on_split"}
    report = check_splits(means_summed, CONFIGURED, rename={"sum_of_means": "num_items_ignored"})
    assert report.mistakes == ["num_items_ignored"]
    with pytest.raises(ValueError, match="not a name of accumlab.mistakes.MISTAKES"):
        check_splits(correct, CONFIGURED, rename={"sum_of_means": "means"})


def test_a_run_that_cannot_be_checked_says_why():
    def refuses(split):
        raise NotChecked("the job drew random numbers")

    report = check_splits(refuses, CONFIGURED)
    assert not report.checked and not report.ok
    assert report.text().startswith("split invariance: not checked: the job drew random numbers")

    def nan(split):
        return as_gradient(torch.full((8,), math.nan, dtype=torch.float64))

    report = check_splits(nan, CONFIGURED)
    assert not report.checked and "not finite" in report.reason
    one = check_splits(correct, Split.uniform(1, 1), splits=[Split((1,), 1)])
    assert not one.checked and "cannot be split otherwise" in one.reason


def test_out_of_memory_skips_a_split_and_the_next_full_split_becomes_the_reference():
    def tight(split):
        if split.microbatches == 1 and split.examples == 8:
            raise torch.OutOfMemoryError("tried to allocate")
        return double(split)

    report = check_splits(tight, CONFIGURED)
    assert report.skipped == ["(8, 1) ran out of memory"]
    assert report.measures[0].against == CONFIGURED
    assert report.mistakes == ["double_division"]  # (1, 8) is 1/2 of (2, 4): A went 4 -> 8


def test_the_held_gradient_is_one_copy_reused_never_narrower_than_float32():
    held = HeldGradient()
    g = [torch.ones(3, dtype=torch.bfloat16), None]
    held.set(g)
    assert held.dtype == torch.float32 and held.tensors[1] is None
    pointer = held.tensors[0].data_ptr()
    held.set([torch.full((3,), 2.0, dtype=torch.bfloat16), torch.ones(2)])
    assert held.tensors[0].data_ptr() == pointer and held.tensors[0].tolist() == [2.0] * 3
    c = held.compare([torch.full((3,), 1.0), torch.ones(2)])
    assert abs(c.factor - (3 * 2 + 2) / (3 * 4 + 2)) < 1e-12
    with pytest.raises(ValueError, match="in the same order every time"):
        held.compare([torch.ones(3)])
    with pytest.raises(ValueError, match="has shape"):
        held.compare([torch.ones(4), torch.ones(2)])


def test_a_parameter_is_compared_in_float64_chunks_with_the_numbers_of_a_whole_one(monkeypatch):
    """The check's memory bound (one float32 copy beyond the job's): a parameter larger
    than CHUNK entries is never widened to float64 whole, and the numbers are those of
    float64 over the whole parameters, computed here in numpy."""
    from accumlab.invariance import gradients

    g = torch.Generator().manual_seed(0)
    big = gradients.CHUNK * 2 + 3
    held = [torch.randn(big, generator=g), torch.randn(5, generator=g), None]
    mine = [0.5 * held[0] + 1e-3 * torch.randn(big, generator=g), None, torch.randn(2, generator=g)]
    widened = []
    double = torch.Tensor.double
    monkeypatch.setattr(torch.Tensor, "double", lambda t: widened.append(t.numel()) or double(t))
    c = gradients.compare(mine, held)
    d = gradients.distance(mine, 1.0, held, 0.5)
    monkeypatch.undo()
    assert max(widened) <= gradients.CHUNK

    x = np.concatenate([mine[0].numpy(), np.zeros(5), mine[2].numpy()]).astype(np.float64)
    y = np.concatenate([held[0].numpy(), held[1].numpy(), np.zeros(2)]).astype(np.float64)
    factor = float(x @ y / (y @ y))
    assert c.factor == pytest.approx(factor, rel=1e-12)
    assert c.relative_error == pytest.approx(np.linalg.norm(x - y) / np.linalg.norm(y), rel=1e-9)
    assert c.residual == pytest.approx(np.linalg.norm(x - factor * y) / np.linalg.norm(x), rel=1e-6)
    assert d == pytest.approx(np.linalg.norm(x - 0.5 * y), rel=1e-9)


def test_the_report_wraps_at_100_characters_and_quotes_the_table():
    report = check_splits(mean_over_a, CONFIGURED)
    text = report.text()
    assert max(len(line) for line in text.splitlines()) <= 100
    flat = " ".join(text.split())
    for name in report.mistakes:
        assert " ".join(MISTAKES[name].fix.split()) in flat
        assert " ".join(report.evidence[name].split()) in flat
    assert flat.endswith(" ".join(report.not_checked.split()))
