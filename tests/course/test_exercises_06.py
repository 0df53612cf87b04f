"""Tests for the exercise checker of notebook 06: the reference passes, the usual wrong
answers fail with a message that names the mistake, a stub reads as not attempted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import accumlab as al
from accumlab_course.data import VOCAB_SIZE, collate, load_examples, microbatches
from accumlab_course.exercises import NOT_ATTEMPTED, ex06
from accumlab_course.models import TinyGPT

torch.set_num_threads(1)

Window = Sequence[Mapping[str, Tensor]]


def _sequence_sum(model: nn.Module, mb: Mapping[str, Tensor], losses: Any) -> Tensor:
    return losses(model(mb["input_ids"]).logits, mb["labels"]).sum()


def token_weighted(model: nn.Module, window: Window, losses: Any) -> None:
    objective = al.NextTokenLoss()
    al.accumulate(model, window, objective)


def average_of_means(model: nn.Module, window: Window, losses: Any) -> None:
    for mb in window:
        (_sequence_sum(model, mb, losses) / mb["labels"].shape[0] / len(window)).backward()


def sum_of_means(model: nn.Module, window: Window, losses: Any) -> None:
    for mb in window:
        (_sequence_sum(model, mb, losses) / mb["labels"].shape[0]).backward()


def no_division(model: nn.Module, window: Window, losses: Any) -> None:
    for mb in window:
        _sequence_sum(model, mb, losses).backward()


def double_division(model: nn.Module, window: Window, losses: Any) -> None:
    total = sum(mb["labels"].shape[0] for mb in window)
    for mb in window:
        (_sequence_sum(model, mb, losses) / total / len(window)).backward()


def zero_grad_inside(model: nn.Module, window: Window, losses: Any) -> None:
    total = sum(mb["labels"].shape[0] for mb in window)
    for mb in window:
        model.zero_grad(set_to_none=True)
        (_sequence_sum(model, mb, losses) / total).backward()


def steps_inside(model: nn.Module, window: Window, losses: Any) -> None:
    ex06.reference_sequence_weighted_window(model, window, losses)
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def does_nothing(model: nn.Module, window: Window, losses: Any) -> None:
    return None


def slightly_off(model: nn.Module, window: Window, losses: Any) -> None:
    total = sum(mb["labels"].shape[0] for mb in window)
    for mb in window:
        (_sequence_sum(model, mb, losses) / (total + 1)).backward()


def test_reference_passes(capsys: Any) -> None:
    assert ex06.sequence_weighted_window.check(ex06.reference_sequence_weighted_window)
    assert "✓ sequence_weighted_window: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (token_weighted, "token-weighted gradient"),
        (average_of_means, "average of the microbatch means"),
        (sum_of_means, "sum of the microbatch means"),
        (no_division, "times the right gradient"),
        (double_division, "you divided twice"),
        (zero_grad_inside, "only the last microbatch"),
        (steps_inside, "the weights changed"),
        (does_nothing, "no gradient at all"),
        (slightly_off, "differs from the sequence-weighted full batch"),
        ("not a function", "expected a function"),
    ],
)
def test_wrong_answers_fail_with_the_named_mistake(answer: Any, reason: str, capsys: Any) -> None:
    message = ex06.check_sequence_weighted_window(answer)
    assert message is not None and reason in message
    assert not ex06.sequence_weighted_window.check(answer)
    assert "✗" in capsys.readouterr().out


def test_a_stub_is_not_attempted(capsys: Any) -> None:
    def stub(model: nn.Module, window: Window, losses: Any) -> None:
        raise NotImplementedError

    assert not ex06.sequence_weighted_window.check(stub)
    out = capsys.readouterr().out
    assert out.startswith("○ sequence_weighted_window: " + NOT_ATTEMPTED)
    assert "ex06.sequence_weighted_window.hint()" in out


def test_checker_leaves_the_global_random_state_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ex06.check_sequence_weighted_window(ex06.reference_sequence_weighted_window)
    assert torch.equal(torch.rand(3), expected)


def test_sequence_losses_is_each_rows_token_mean() -> None:
    batch = collate(load_examples(limit=3))
    logits = torch.randn(*batch["input_ids"].shape, VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    got = ex06.sequence_losses(logits, batch["labels"])
    objective = al.NextTokenLoss()
    for row in range(3):
        one = {k: v[row : row + 1] for k, v in batch.items()}
        expected = objective.loss_sum(logits[row : row + 1], one) / objective.count(one)
        torch.testing.assert_close(got[row], expected)


def test_sequence_losses_rejects_a_sequence_without_targets() -> None:
    labels = torch.tensor([[5, 6, 7], [-100, -100, -100]])
    with pytest.raises(ValueError, match="no supervised target"):
        ex06.sequence_losses(torch.zeros(2, 3, 10), labels)
    with pytest.raises(ValueError, match=r"\(batch, seq, vocab\)"):
        ex06.sequence_losses(torch.zeros(2, 3), labels)


def test_hints_and_solution_print(capsys: Any) -> None:
    ex06.sequence_weighted_window.hint(3)
    ex06.sequence_weighted_window.solution()
    out = capsys.readouterr().out
    assert "hint 3/3" in out and "def reference_sequence_weighted_window" in out


# ---------------------------------------------------------------- predict first


@pytest.mark.parametrize(
    ("exercise", "right", "wrong", "named"),
    [
        (ex06.batchnorm_passes, 80, 10, "counts updates"),
        (ex06.batchnorm_passes, 80, 8, "one window's passes"),
        (ex06.batchnorm_passes, 80, 640, "counts examples"),
        (ex06.batchnorm_passes, 80, 81, "count the forward passes"),
        (ex06.batchnorm_passes, 80, "80", "expected a number"),
        (ex06.examples_at_16_updates, 128, 512, "what the A = 4 runs saw"),
        (ex06.examples_at_16_updates, 128, 16, "the updates themselves"),
        (ex06.examples_at_16_updates, 128, 64, "over the whole 512 examples"),
        (ex06.examples_at_16_updates, 128, 100, "run the next cell"),
        (ex06.examples_at_16_updates, 128, "128", "as a number"),
    ],
)
def test_predictions_pass_and_name_each_mistake(
    exercise: Any, right: Any, wrong: Any, named: str, capsys: Any
) -> None:
    assert exercise.check(right)
    assert not exercise.check(wrong)
    out = capsys.readouterr().out
    assert f"✓ {exercise.name}: correct" in out and named in out, out


def test_the_predictions_hold_for_what_the_notebook_computes() -> None:
    # batchnorm_passes: BatchNorm counts one forward pass per microbatch, 8 per window of
    # A = 8, over 10 windows. examples_at_16_updates: al.train at m = 8, A = 1 on 512
    # examples, stopped after 16 updates, has read 16 loader batches of 8.
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    for _ in range(10 * 8):
        bn(torch.randn(8, 3))
    assert int(bn.num_batches_tracked) == ex06.batchnorm_passes.answer
    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE, n_layer=1, n_embd=16)
    ledger = al.train(model, microbatches(load_examples(limit=512), 8), torch.optim.SGD(
        model.parameters(), lr=0.1), al.AccumulationPlan(8, 1), al.NextTokenLoss(),
        max_updates=16, progress=False)
    assert ledger.examples == ex06.examples_at_16_updates.answer


# ---------------------------------------------------------------- in-batch negatives


Pairs = Sequence[Mapping[str, Tensor]]


def per_microbatch_weighted(model: nn.Module, window: Pairs, loss_fn: Any) -> None:
    n = sum(len(mb["queries"]) for mb in window)
    for mb in window:
        (loss_fn(model(mb["queries"]), model(mb["keys"])) * len(mb["queries"]) / n).backward()


def per_microbatch_average(model: nn.Module, window: Pairs, loss_fn: Any) -> None:
    for mb in window:
        (loss_fn(model(mb["queries"]), model(mb["keys"])) / len(window)).backward()


def per_microbatch_sum(model: nn.Module, window: Pairs, loss_fn: Any) -> None:
    for mb in window:
        loss_fn(model(mb["queries"]), model(mb["keys"])).backward()


def whole_window_at_once(model: nn.Module, window: Pairs, loss_fn: Any) -> None:
    queries = torch.cat([mb["queries"] for mb in window])
    keys = torch.cat([mb["keys"] for mb in window])
    loss_fn(model(queries), model(keys)).backward()


def cached_but_steps(model: nn.Module, window: Pairs, loss_fn: Any) -> None:
    ex06.reference_contrastive_window(model, window, loss_fn)
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def cached_twice_the_gradient(model: nn.Module, window: Pairs, loss_fn: Any) -> None:
    ex06.reference_contrastive_window(model, window, lambda q, k: 2 * loss_fn(q, k))


def embeds_but_never_backpropagates(model: nn.Module, window: Pairs, loss_fn: Any) -> None:
    with torch.no_grad():
        for mb in window:
            model(mb["queries"])


def test_contrastive_reference_passes(capsys: Any) -> None:
    assert ex06.contrastive_window.check(ex06.reference_contrastive_window)
    assert "✓ contrastive_window: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (per_microbatch_weighted, "accumulated per-microbatch loss"),
        (per_microbatch_average, "average of per-microbatch losses"),
        (per_microbatch_sum, "sum of per-microbatch losses"),
        (whole_window_at_once, "rows at once, more than a microbatch"),
        (cached_but_steps, "the weights changed"),
        (cached_twice_the_gradient, "differs from the whole window's loss"),
        (embeds_but_never_backpropagates, "no gradient at all"),
        ("not a function", "expected a function"),
    ],
)
def test_contrastive_wrong_answers_name_the_mistake(answer: Any, reason: str, capsys: Any) -> None:
    assert not ex06.contrastive_window.check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✗ contrastive_window:") and reason in out, out


def test_info_nce_matches_its_definition_and_rejects_bad_shapes() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    qn, kn = q / q.norm(dim=1, keepdim=True), k / k.norm(dim=1, keepdim=True)
    scores = qn @ kn.T / 0.1
    expected = -(scores.diag() - scores.logsumexp(dim=1)).mean()
    torch.testing.assert_close(ex06.info_nce(q, k), expected)
    with pytest.raises(ValueError, match=r"\(n, dim\)"):
        ex06.info_nce(q, k[:4])


def test_new_stubs_are_not_attempted(capsys: Any) -> None:
    def stub(*args: Any) -> None:
        raise NotImplementedError

    for exercise, answer in ((ex06.contrastive_window, stub), (ex06.batchnorm_passes, ...),
                             (ex06.examples_at_16_updates, ...)):
        assert not exercise.check(answer)
        out = capsys.readouterr().out
        assert out.startswith(f"○ {exercise.name}: {NOT_ATTEMPTED}")


def test_committed_notebook_ships_every_exercise_unsolved() -> None:
    from helpers.notebook_exercises import assert_unsolved

    assert_unsolved(
        "06_when_equivalence_ends.ipynb",
        {
            "sequence_weighted_window": "ex06",
            "contrastive_window": "ex06",
            "batchnorm_passes": "ex06",
            "examples_at_16_updates": "ex06",
        },
    )


# ------------------------------------------------------------ section 4's run


def test_held_out_run_measures_on_the_examples_axis():
    examples = load_examples()
    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE, n_layer=1, n_embd=16)
    held_out = collate(examples[1900:1908])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ledger, curve = ex06.held_out_run(model, examples[:64], held_out, accumulation_steps=2,
                                      lr=1e-3, micro_batch_size=4, every=16)
    assert ledger.examples == 64 and ledger.updates_applied == 8  # 64 / (4 × 2)
    assert curve.seen == [0, 16, 32, 48, 64] and curve.updates == [0, 2, 4, 6, 8]
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())  # a copy trained
    # the first point is the untrained model's token-mean loss on the held-out batch
    tokens = al.NextTokenLoss()
    with torch.no_grad():
        first = float(tokens.loss_sum(model(held_out["input_ids"]), held_out)) / tokens.count(held_out)
    assert curve.values[0] == pytest.approx(first)
    with pytest.raises(ValueError, match="every=12 is not a multiple of the 8 examples"):
        ex06.held_out_run(model, examples[:64], held_out, 2, 1e-3, micro_batch_size=4, every=12)
