"""accumlab.lightning's SplitInvarianceCallback on Lightning 2.6 jobs (a tiny GPT-2 on padded
examples of uneven length, accumulate_grad_batches=4), each verdict tested against the
truth measured without accumlab: the real updates of SGD (lr 1) read off the weights, at
the configured split and at others (separate Lightning runs), and the token mean computed
one example at a time. The runs are shared by the module (Lightning is slow to import)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers import lightning_jobs as jobs  # noqa: E402

from accumlab.invariance import Split  # noqa: E402
from accumlab.lightning import AccumulationCheckWarning, SplitInvarianceCallback  # noqa: E402

M, A, N = jobs.M, jobs.A, jobs.M * jobs.A
DATA = jobs.examples(N + M)  # one full window and a short last window of one microbatch


def checked(module_class, **options):
    callback = SplitInvarianceCallback(**options)
    module, applied, caught = jobs.fit(module_class, DATA, M, A, [callback])
    return callback, module, applied, caught


@pytest.fixture(scope="module")
def mean_run():
    return checked(jobs.MeanLoss)


@pytest.fixture(scope="module")
def token_sum_run():
    return checked(jobs.TokenSum)


@pytest.fixture(scope="module")
def truth_mean(mean_run):
    """The mean-loss job's real first updates at (8, 1) and (1, 8) on the window's examples,
    and the short last window's examples trained with A = 1 from where the run had them."""
    window = DATA[:N]
    _, whole, _ = jobs.fit(jobs.MeanLoss, window, N, 1)
    _, finest, _ = jobs.fit(jobs.MeanLoss, window, 1, N)
    after_first = jobs.flat(jobs.gpt2()) - mean_run[2][0]  # SGD, lr 1
    _, alone, _ = jobs.fit(jobs.MeanLoss, DATA[N:], M, 1, weights=after_first)
    return {"whole": whole[0], "finest": finest[0], "alone": alone[0]}


def test_the_mean_loss_module_is_an_average_of_averages_with_a_short_window_divided_by_a(
    mean_run, truth_mean
):
    callback, module, applied, caught = mean_run
    report = callback.report
    assert report.mistakes == ["average_of_averages", "short_window_divided_by_a"], report.text()
    # every number the report gives is the one the real updates give
    configured = report.measure(Split.uniform(M, A))
    assert configured.relative_error == pytest.approx(
        jobs.relative_error(applied[0], truth_mean["whole"]), rel=1e-3)
    finest = report.measure(Split((1,) * N, N))
    assert finest.relative_error == pytest.approx(
        jobs.relative_error(truth_mean["finest"], truth_mean["whole"]), rel=1e-3)
    token_mean = jobs.token_mean_gradient(DATA[:N])
    objective = report.measure(Split.uniform(M, A), "objective")
    assert objective.relative_error == pytest.approx(jobs.relative_error(applied[0], token_mean), rel=1e-3)
    assert objective.relative_error > 0.05  # the mean per microbatch is far from the token mean
    # Lightning's own short last window (one microbatch) is scaled 1/4, as the report says
    assert jobs.factor(applied[1], truth_mean["alone"]) == pytest.approx(1 / A, rel=1e-5)
    short = report.measure(Split((M,), A), "short")
    assert short.factor == pytest.approx(1 / A, rel=1e-6)
    assert "the module returns its Hugging Face model's .loss (GPT2LMHeadModel)" in report.notes
    assert any(w.category is AccumulationCheckWarning and "average_of_averages" in str(w.message)
               for w in caught)


def test_a_correct_token_sum_module_is_ok(token_sum_run):
    callback, module, applied, caught = token_sum_run
    report = callback.report
    assert report.ok, report.text()
    assert jobs.relative_error(applied[0], jobs.token_mean_gradient(DATA[:N])) < 1e-5  # the truth
    after_first = jobs.flat(jobs.gpt2()) - applied[0]  # SGD, lr 1
    assert jobs.relative_error(applied[1], jobs.token_mean_gradient(DATA[N:], after_first)) < 1e-5
    assert all(m.relative_error < 1e-5 for m in report.measures)
    assert not any(w.category is AccumulationCheckWarning for w in caught)


@pytest.mark.parametrize("module_class", [jobs.MeanLoss, jobs.TokenSum])
def test_the_run_is_bit_identical_with_and_without_the_callback(module_class, mean_run, token_sum_run):
    with_check = mean_run if module_class is jobs.MeanLoss else token_sum_run
    module, applied, _ = jobs.fit(module_class, DATA, M, A)
    assert all(torch.equal(a, b) for a, b in zip(with_check[1].parameters(), module.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(with_check[2], applied, strict=True))


class Dropout(jobs.MeanLoss):
    def __init__(self, model):
        super().__init__(model)
        self.drop = torch.nn.Dropout(0.1)

    def training_step(self, batch, batch_idx):
        return self.drop(super().training_step(batch, batch_idx))


class Manual(jobs.MeanLoss):
    def __init__(self, model):
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


def test_what_it_cannot_check_it_says_in_one_line_and_the_run_goes_on(monkeypatch):
    callback, module, applied, _ = checked(Dropout, on_mistake="ignore")
    assert not callback.report.checked
    assert callback.report.reason.startswith("the training_step at (2, 4) drew random numbers")
    plain, plain_applied, _ = jobs.fit(Dropout, DATA, M, A)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), plain.parameters(), strict=True))

    callback = SplitInvarianceCallback(on_mistake="ignore")
    jobs.fit(Manual, DATA, M, 1, [callback])  # Lightning accumulates only automatically
    assert callback.report.reason.startswith("the module optimizes manually")

    from accumlab.lightning import replay

    def broken(self, split):
        raise RuntimeError("replay broke")

    monkeypatch.setattr(replay.Replay, "__call__", broken)
    callback, module, applied, _ = checked(jobs.TokenSum, on_mistake="ignore")
    assert callback.report.reason == "the check failed: RuntimeError: replay broke"
    reference, reference_applied, _ = jobs.fit(jobs.TokenSum, DATA, M, A)
    assert all(torch.equal(a, b) for a, b in zip(applied, reference_applied, strict=True))
