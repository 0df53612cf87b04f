"""An Accelerate loop (``accelerator.accumulate(model)`` with the user's own loss) audited
by ``al.audit`` as it stands: the window function is the user's loop body for one window.

``accelerator.backward(loss)`` divides the loss by ``accelerator.gradient_accumulation_steps``
(outside DeepSpeed), so a loop that divides its summed token loss by the window's target
count must multiply that division back; one that passes each microbatch's mean averages
averages, and one that also divides by A itself divides twice. The audit names each.
Skipped when Accelerate (the ``peers`` extra, also in ``dev``) is not installed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.nn.functional as F

import accumlab as al

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def accelerator():
    return accelerate.Accelerator(cpu=True)


def window_targets(window):
    """Supervised targets of the window, counted before any forward pass."""
    return sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)


def summed_loss(model, mb):
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1),
        mb["labels"][:, 1:].flatten(),
        ignore_index=-100,
        reduction="sum",
    )


def loop(accelerator, loss_of, *, per_window_a=True):
    """The window function around the user's loss: ``loss_of(model, mb, window)`` is what
    goes to ``accelerator.backward`` for one microbatch."""

    def train_one_window(model, optimizer, scheduler, window):
        if per_window_a:  # the window's A: the last window may be short
            accelerator.gradient_accumulation_steps = len(window)
        for mb in window:
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, mb, window))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    return train_one_window


def test_a_correct_accelerate_loop_is_ok(accelerator):
    def loss_of(model, mb, window):
        # backward() divides by gradient_accumulation_steps: multiply it back
        a = accelerator.gradient_accumulation_steps
        return summed_loss(model, mb) / window_targets(window) * a

    for per_window_a in (True, False):  # with A fixed, the undone division still holds
        accelerator.gradient_accumulation_steps = 4
        report = al.audit(loop(accelerator, loss_of, per_window_a=per_window_a))
        assert report.ok, str(report)
        assert all(w.update_error < 1e-10 for w in report.windows)
    # A second audit with the same accelerator (its microbatch counter has moved on)
    report = al.audit(loop(accelerator, loss_of))
    assert report.ok, str(report)


def test_the_mean_per_microbatch_loop_is_named(accelerator):
    """Accelerate's usual loop: the model's mean loss of each microbatch, divided by A in
    backward(): each microbatch counts the same whatever its number of targets."""
    report = al.audit(loop(accelerator, lambda model, mb, window: model(**mb).loss))
    assert not report.ok
    assert report.mistakes == ["average_of_averages"], str(report)
    assert "(A × targets in the microbatch)" in report.evidence["average_of_averages"]


def test_the_window_mean_without_undoing_backwards_division_is_a_double_division(accelerator):
    """The loss of a correct hand-written loop (summed over the window's targets), given to
    accelerator.backward() as it is: backward() divides it by A once more."""

    def loss_of(model, mb, window):
        return summed_loss(model, mb) / window_targets(window)

    report = al.audit(loop(accelerator, loss_of))
    assert report.mistakes == ["double_division"], str(report)


def test_a_fixed_a_mean_loop_is_never_ok(accelerator):
    """With A fixed at 4, the mean loop divides the short last window (2 microbatches) by
    4 as well: not a pure average of averages, and never reported as ok."""
    accelerator.gradient_accumulation_steps = 4
    report = al.audit(
        loop(accelerator, lambda model, mb, window: model(**mb).loss, per_window_a=False)
    )
    assert not report.ok
    assert report.mistakes or report.other


def test_the_readme_loop_runs_as_printed():
    """docs/AUDIT.md's Accelerate section shows a window function and its audit: run that code
    block as it stands, and its audit is ok."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "AUDIT.md").read_text(encoding="utf-8")
    section = readme.partition("\n## An Accelerate loop\n")[2]
    block = re.search(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert block, "docs/AUDIT.md has no python block under '## An Accelerate loop'"
    namespace: dict = {}
    exec(compile(block.group(1), "docs/AUDIT.md", "exec"), namespace)
    assert namespace["report"].ok, str(namespace["report"])
