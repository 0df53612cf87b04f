"""Property tests: accumulation reproduces the full-batch mean gradient for any split.

Hypothesis draws variable-length token batches (right padding, random prompt masks, some
rows possibly without targets), cuts them into microbatches of uneven sizes, groups the
microbatches into windows with ``AccumulationPlan.windows`` (a short last window
included) and checks that the gradient ``train_window`` hands to the optimizer equals the
token-mean gradient of the same examples taken as one batch, computed with plain
``F.cross_entropy`` (relative error ≤ 1e-5 in float32, ≤ 1e-10 in float64). The same for
``ExampleLoss`` against the sample mean.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from helpers.batches import rows, targets_of, token_batch, trim
from helpers.gradients import capture, params, reference_gradient, rel_error, token_mean_gradient
from helpers.models import CausalToy, small_gpt
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import accumlab as al
from accumlab_course.data import VOCAB_SIZE
from accumlab_course.models import MLP

RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}
SETTINGS = settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])


def _toy(dtype: torch.dtype) -> CausalToy:
    torch.manual_seed(1)
    return CausalToy(vocab_size=VOCAB_SIZE).to(dtype)


# Built once: the checks below never change the weights (CaptureOptimizer only records).
MODELS: dict[tuple[str, torch.dtype], nn.Module] = {
    (kind, dtype): (_toy(dtype) if kind == "toy" else small_gpt(dtype, seed=2))
    for kind in ("toy", "gpt")
    for dtype in (torch.float32, torch.float64)
}


@dataclass
class TokenProblem:
    """A batch, its uneven split into microbatches, and an accumulation length ``A``."""

    batch: dict[str, Tensor]
    sizes: list[int]
    steps: int
    model: str
    dtype: torch.dtype

    def microbatches(self) -> list[dict[str, Tensor]]:
        out, start = [], 0
        for size in self.sizes:
            out.append(trim(rows(self.batch, start, start + size)))  # own padding width
            start += size
        return out


def _sizes(n: int, cuts: set[int]) -> list[int]:
    bounds = [0, *sorted(cuts), n]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@st.composite
def splits(draw: st.DrawFn, n: int) -> list[int]:
    """Microbatch sizes adding up to ``n``: every composition of ``n`` is reachable."""
    if n == 1:
        return [1]
    count = draw(st.integers(1, n))  # microbatches
    cuts = draw(st.sets(st.integers(1, n - 1), min_size=count - 1, max_size=count - 1))
    return _sizes(n, cuts)


@st.composite
def token_problems(draw: st.DrawFn) -> TokenProblem:
    shapes = draw(
        st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=12)
    )
    examples = [(length, min(prompt, length)) for length, prompt in shapes]
    if all(length - max(prompt, 1) <= 0 for length, prompt in examples):
        # the full batch needs at least one target; other rows may have none
        examples[0] = (max(examples[0][0], 2), 0)
    batch = token_batch(examples, vocab=VOCAB_SIZE, seed=draw(st.integers(0, 2**16)))
    sizes = draw(splits(len(examples)))
    # prefer an A that leaves a short last window whenever the microbatch count allows one
    short = [a for a in range(2, len(sizes)) if len(sizes) % a]
    steps = draw(st.sampled_from([*short, 1]) if short else st.integers(1, len(sizes)))
    return TokenProblem(
        batch=batch,
        sizes=sizes,
        steps=steps,
        model=draw(st.sampled_from(["toy", "gpt"])),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
    )


@SETTINGS
@given(problem=token_problems())
def test_every_window_gets_its_token_mean_gradient(problem: TokenProblem) -> None:
    model = MODELS[problem.model, problem.dtype]
    rtol = RTOL[problem.dtype]
    pieces = problem.microbatches()
    assert targets_of(problem.batch) > 0
    objective = al.NextTokenLoss()

    # 1. the whole batch as one window: train_window's gradient is the full-batch one
    full = token_mean_gradient(model, [problem.batch])
    optimizer = capture(model)
    report = al.train_window(model, pieces, optimizer, objective)
    assert report.applied and report.targets == targets_of(problem.batch)
    assert rel_error(full, optimizer.seen[0]) <= rtol

    # 2. windows of A microbatches, the last one possibly short: each window's gradient
    #    is the token mean over its own examples, and weighting the windows by their
    #    target counts gives back the full-batch gradient
    plan = al.AccumulationPlan(max(problem.sizes), problem.steps)
    windows = list(plan.windows(pieces))
    event("short last window" if not windows[-1].complete else "full windows only")
    assert [len(w) for w in windows[:-1]] == [problem.steps] * (len(windows) - 1)
    total = targets_of(problem.batch)
    combined = {n: torch.zeros_like(g) for n, g in full.items()}
    for window in windows:
        optimizer = capture(model)
        report = al.train_window(model, window.microbatches, optimizer, objective)
        count = sum(targets_of(mb) for mb in window)
        assert report.targets == report.global_targets == count
        if count == 0:
            assert not report.applied and report.skipped_reason == "no targets"
            assert optimizer.seen == []
            continue
        assert report.applied and len(optimizer.seen) == 1
        assert rel_error(token_mean_gradient(model, window.microbatches), optimizer.seen[0]) <= rtol
        for n, g in optimizer.seen[0].items():
            combined[n] += g * (count / total)
    assert rel_error(full, combined) <= rtol


@SETTINGS
@given(problem=token_problems(), policy=st.sampled_from(["update", "drop"]))
def test_train_matches_window_references_and_counts(problem: TokenProblem, policy: str) -> None:
    model = MODELS[problem.model, problem.dtype]
    pieces = problem.microbatches()
    m = max(problem.sizes)
    plan = al.AccumulationPlan(m, problem.steps, last_window=policy)  # type: ignore[arg-type]
    windows = list(plan.windows(pieces))
    trained = [w for w in windows if w.complete or policy == "update"]
    dropped = [mb for w in windows if not (w.complete or policy == "update") for mb in w]
    assert len(dropped) <= problem.steps - 1  # only a short last window can be dropped

    optimizer = capture(model)
    ledger = al.train(model, pieces, optimizer, plan, al.NextTokenLoss(), progress=False)
    with_targets = [w for w in trained if sum(targets_of(mb) for mb in w) > 0]
    empty = [w for w in trained if sum(targets_of(mb) for mb in w) == 0]
    assert len(optimizer.seen) == len(with_targets) == ledger.updates_applied
    for window, seen in zip(with_targets, optimizer.seen, strict=True):
        reference = token_mean_gradient(model, window.microbatches)
        assert rel_error(reference, seen) <= RTOL[problem.dtype]

    assert ledger.update_attempts == len(trained)
    assert ledger.updates_skipped == len(empty)
    assert [r.skipped_reason for r in ledger.reports].count("no targets") == len(empty)
    assert ledger.loader_batches == len(pieces)
    # a window without targets runs no forward or backward pass
    assert ledger.backward_passes == sum(len(w) for w in with_targets)
    assert ledger.examples == sum(int(mb["labels"].shape[0]) for w in trained for mb in w)
    assert ledger.targets == sum(targets_of(mb) for w in trained for mb in w)
    assert ledger.dropped_examples == sum(int(mb["labels"].shape[0]) for mb in dropped)
    assert ledger.dropped_targets == sum(targets_of(mb) for mb in dropped)
    assert ledger.examples + ledger.dropped_examples == len(problem.batch["labels"])


@settings(deadline=None, max_examples=15)
@given(problem=token_problems())
def test_sgd_step_with_lr_1_moves_weights_by_the_full_batch_gradient(problem: TokenProblem) -> None:
    """float64 only: the weight change of one SGD(lr=1) update is the gradient itself."""
    start = MODELS[problem.model, torch.float64]
    model = copy.deepcopy(start)
    reference = token_mean_gradient(start, [problem.batch])
    before = params(model)
    al.train_window(
        model,
        problem.microbatches(),
        torch.optim.SGD(model.parameters(), lr=1.0),
        al.NextTokenLoss(),
    )
    change = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    assert rel_error(reference, change) <= 1e-9


# ------------------------------------------------------------------- ExampleLoss


MLPS = {dtype: (torch.manual_seed(3), MLP(5, 7, 4).to(dtype))[1] for dtype in RTOL}


@st.composite
def example_problems(draw: st.DrawFn) -> tuple[dict[str, Tensor], list[int], int, str, torch.dtype]:
    n = draw(st.integers(1, 12))
    loss = draw(st.sampled_from(["cross_entropy", "mse"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(n, 5, generator=g, dtype=dtype)
    labels = (
        torch.randint(0, 4, (n,), generator=g)
        if loss == "cross_entropy"
        else torch.randn(n, 4, generator=g, dtype=dtype)
    )
    sizes = draw(splits(n))
    return {"x": x, "labels": labels}, sizes, draw(st.integers(1, len(sizes))), loss, dtype


def sample_mean_gradient(model: nn.Module, batch: dict[str, Tensor], loss: str) -> dict:
    fn = F.cross_entropy if loss == "cross_entropy" else F.mse_loss
    return reference_gradient(model, lambda m: fn(m(batch["x"]), batch["labels"]))


@SETTINGS
@given(problem=example_problems())
def test_example_loss_windows_get_the_sample_mean_gradient(problem: tuple) -> None:
    batch, sizes, steps, loss, dtype = problem
    model = MLPS[dtype]
    objective = al.ExampleLoss(loss)
    pieces = al.split_batch(batch, sizes)

    optimizer = capture(model)
    al.train_window(model, pieces, optimizer, objective)
    assert rel_error(sample_mean_gradient(model, batch, loss), optimizer.seen[0]) <= RTOL[dtype]

    for window in al.AccumulationPlan(max(sizes), steps).windows(pieces):
        optimizer = capture(model)
        report = al.train_window(model, window.microbatches, optimizer, objective)
        joined = {k: torch.cat([mb[k] for mb in window]) for k in batch}
        assert report.examples == report.targets == len(joined["labels"])
        reference = sample_mean_gradient(model, joined, loss)
        assert rel_error(reference, optimizer.seen[0]) <= RTOL[dtype]
