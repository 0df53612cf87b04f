"""The window boundary in one process: no update is silently wrong.

Overflowing norms, an optimizer that holds none or only some of the model's parameters,
a model with nothing to train, an out-of-memory error inside ``optimizer.step`` and an
exception in the middle of a window.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import Tensor, nn

import accumlab as al


def per_example(output: Tensor, labels: Tensor) -> Tensor:
    return output


class Dot(nn.Module):
    """``output = x · w`` per example, so the gradient of the summed output is ``Σ x``."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(features))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


class TwoHeads(nn.Module):
    """Two :class:`Dot` parts whose outputs add up: ``left`` and ``right``."""

    def __init__(self) -> None:
        super().__init__()
        self.left = Dot()
        self.right = Dot()

    def forward(self, x: Tensor) -> Tensor:
        return self.left(x) + self.right(x)


def batch(value: float, rows: int = 1, features: int = 4) -> dict[str, Tensor]:
    return {"x": torch.full((rows, features), value), "labels": torch.zeros(rows)}


OBJECTIVE = al.ExampleLoss(per_example)


# ------------------------------------------------------------------ item 4: norm overflow


def test_finite_gradients_whose_fp32_norm_overflows_are_clipped_not_zeroed():
    model = Dot()  # float32; every gradient entry is 1e20, the fp32 sum of squares is inf
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    report = al.train_window(model, [batch(1e20)], optimizer, OBJECTIVE, clip_grad_norm=1.0)
    assert report.applied
    assert math.isclose(report.grad_norm, 2e20, rel_tol=1e-6)  # sqrt(4) * 1e20, finite
    # clipped to norm 1: each of the 4 entries is 0.5, so one SGD step moves w by -0.5
    torch.testing.assert_close(model.w.detach(), torch.full((4,), -0.5))


def test_overflowing_norm_without_clipping_is_reported_finite_and_applied():
    model = Dot()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    report = al.train_window(model, [batch(1e20)], optimizer, OBJECTIVE)
    assert report.applied and math.isfinite(report.grad_norm)
    torch.testing.assert_close(model.w.detach(), torch.full((4,), -1e20))


def test_clipping_uses_the_one_norm_it_reports(monkeypatch):
    calls = []
    real = torch.nn.utils.get_total_norm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", counting)
    model = Dot()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    report = al.train_window(model, [batch(3.0)], optimizer, OBJECTIVE, clip_grad_norm=1.0)
    assert len(calls) == 1  # measured once, reused for clipping
    assert math.isclose(report.grad_norm, 6.0, rel_tol=1e-6)
    torch.testing.assert_close(model.w.detach(), torch.full((4,), -0.5))


# ------------------------------------------------------------------ item 5: optimizer


def reading(batches, log):
    for b in batches:
        log.append(b)
        yield b


def test_optimizer_holding_none_of_the_models_parameters_is_refused_before_reading_data():
    model, other = Dot(), Dot()
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    read: list = []
    plan = al.AccumulationPlan(1, 2)
    with pytest.raises(ValueError, match="optimizer holds none of the model's"):
        al.train(model, reading([batch(1.0)] * 4, read), optimizer, plan, OBJECTIVE, progress=False)
    assert read == []


def test_train_window_refuses_such_an_optimizer_before_the_forward():
    model, other = Dot(), Dot()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match="optimizer holds none of the model's"):
        al.train_window(model, [batch(1.0)], torch.optim.SGD(other.parameters(), lr=0.1), OBJECTIVE)
    assert calls == []


def test_parameters_the_optimizer_does_not_hold_are_cleared_left_out_and_named_once():
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.left.parameters(), lr=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = al.train_window(model, [batch(1.0)], optimizer, OBJECTIVE)
        with al.inject_nonfinite(model.right.w):  # an inf outside the optimizer's set
            second = al.train_window(model, [batch(1.0)], optimizer, OBJECTIVE, clip_grad_norm=100)
    named = [w for w in caught if "right.w" in str(w.message)]
    assert len(named) == 1 and "does not hold" in str(named[0].message)
    assert first.applied and second.applied  # the orphan's inf neither skips nor enters
    assert math.isclose(second.grad_norm, 2.0, rel_tol=1e-6)  # only left.w: sqrt(4 * 1²)
    assert model.right.w.grad is None  # cleared every window, never accumulating
    torch.testing.assert_close(model.left.w.detach(), torch.full((4,), -2.0))
    torch.testing.assert_close(model.right.w.detach(), torch.zeros(4))


def test_a_model_with_no_trainable_parameters_is_a_clear_error():
    model = Dot().requires_grad_(False)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="no trainable parameters"):
        al.train_window(model, [batch(1.0)], optimizer, OBJECTIVE)
    with pytest.raises(ValueError, match="no trainable parameters"):
        al.train(
            model, [batch(1.0)], optimizer, al.AccumulationPlan(1, 1), OBJECTIVE, progress=False
        )


# ------------------------------------------------------------------ item 9: OOM in step


class OutOfMemoryHalfway(torch.optim.SGD):
    """SGD that updates its first parameter, then runs out of memory."""

    def step(self, closure=None):  # type: ignore[override]
        with torch.no_grad():
            first = self.param_groups[0]["params"][0]
            first.add_(first.grad, alpha=-self.param_groups[0]["lr"])
        raise torch.OutOfMemoryError("simulated: out of memory in the optimizer")


@pytest.mark.parametrize("on_oom", ["raise", "shrink"])
def test_out_of_memory_inside_optimizer_step_says_the_update_was_partly_applied(on_oom):
    model = TwoHeads()
    optimizer = OutOfMemoryHalfway(model.parameters(), lr=1.0)
    plan = al.AccumulationPlan(2, 1)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        al.train(
            model, [batch(1.0, rows=2)], optimizer, plan, OBJECTIVE, on_oom=on_oom, progress=False
        )
    message = str(caught.value)
    assert "partly applied" in message and "inconsistent" in message
    assert "checkpoint" in message
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ item 10: interrupted


class FailsOnSecondCall(nn.Module):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.dot = Dot()
        self.calls = 0
        self.error = error

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 2:
            raise self.error
        return self.dot(x)


@pytest.mark.parametrize("error", [RuntimeError("data went bad"), KeyboardInterrupt()])
def test_an_exception_mid_window_leaves_no_partial_gradient(error):
    model = FailsOnSecondCall(error)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(type(error)):
        al.train_window(model, [batch(1.0), batch(2.0)], optimizer, OBJECTIVE)
    assert model.calls == 2
    assert all(p.grad is None for p in model.parameters())
