"""Exercises for notebook 03 (mixed precision and the GradScaler).

- ``window_boundary``: write the end of an fp16 accumulation window,
  ``window_boundary(model, optimizer, scaler, max_norm) -> None``. When it is called,
  every microbatch of the window has already backpropagated ``scaler.scale(loss)``, so
  each ``.grad`` holds the window's gradient multiplied by the scale. The function must
  make the five calls of the boundary in the right order: unscale the gradients once,
  clip the combined unscaled gradient to ``max_norm``, step through the scaler (which
  skips the update when a gradient is inf/nan), update the scale, clear the gradients.

The checker runs the answer on a fresh MLP whose window was accumulated under fp16
autocast with a recording GradScaler and optimizer, once with finite gradients and once
with an inf injected into one gradient, and compares the weights, the scale and the call
order with the reference. Its messages name the usual mistakes: clipping before
unscaling (the clip then sees gradients multiplied by the scale), stepping the optimizer
directly (an inf gradient then reaches the weights), updating the scale before the step,
clearing the gradients too early, unscaling twice.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...loop import accumulate
from ...objectives import ExampleLoss
from ...precision import inject_nonfinite
from ..models import MLP
from . import Exercise

#: Relative tolerance on the weights after the update: both runs do the same float32 math.
RTOL = 1e-5
#: The order the checker expects, as the recording scaler and optimizer log it (the clip
#: is checked by the norm of the gradient the optimizer receives, not by a log entry).
EXPECTED = ["unscale_", "scaler.step", "optimizer.step", "update", "zero_grad"]


def reference_window_boundary(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    max_norm: float,
) -> None:
    """The five calls at the end of an fp16 window, in order."""
    scaler.unscale_(optimizer)  # once, after the last backward: .grad is now the true gradient
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the combined, unscaled one
    scaler.step(optimizer)  # skips optimizer.step() if any gradient is inf/nan
    scaler.update()  # grows the scale, or backs it off after a skip
    optimizer.zero_grad(set_to_none=True)  # the next window starts from nothing


class _Log:
    """What the recording scaler and optimizer saw, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.norm_at_step: float | None = None


class _RecordingScaler(torch.amp.GradScaler):
    def __init__(self, log: _Log) -> None:
        super().__init__("cpu", init_scale=2.0**10)
        self.log = log

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.calls.append("unscale_")
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.log.calls.append("scaler.step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        self.log.calls.append("update")
        super().update(new_scale)


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, parameters: Any, log: _Log) -> None:
        super().__init__(parameters, lr=0.5)
        self.log = log

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        self.log.calls.append("optimizer.step")
        self.log.norm_at_step = _norm(self)
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.calls.append("zero_grad")
        super().zero_grad(set_to_none=set_to_none)


def _norm(optimizer: torch.optim.Optimizer) -> float:
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])))


def _case(seed: int = 3) -> tuple[nn.Module, list[dict[str, Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 6, generator=g)
    labels = torch.randint(0, 3, (9,), generator=g)
    torch.manual_seed(seed)
    model = MLP(6, 12, 3)
    window = [{"x": x[i : i + 3], "labels": labels[i : i + 3]} for i in (0, 3, 6)]
    return model, window


def _run(
    answer: Callable[..., Any],
    model: nn.Module,
    window: list[dict[str, Tensor]],
    max_norm: float | None,
    poison: bool,
) -> tuple[_Log, _RecordingScaler, Exception | None]:
    """Accumulate the window under fp16 with a recording scaler, then call ``answer``."""
    log = _Log()
    scaler = _RecordingScaler(log)
    optimizer = _RecordingSGD(model.parameters(), log)
    optimizer.zero_grad(set_to_none=True)
    guard = inject_nonfinite(next(model.parameters())) if poison else contextlib.nullcontext()
    with guard:
        accumulate(model, window, ExampleLoss(), precision="fp16", scaler=scaler)
    log.calls.clear()  # only the boundary counts
    try:
        answer(model, optimizer, scaler, max_norm)
    except Exception as exc:  # report what the learner's order made PyTorch say
        return log, scaler, exc
    return log, scaler, None


def _order_problem(calls: list[str]) -> str | None:
    """The first ordering mistake among the recorded scaler and optimizer calls (also on
    a prefix of them, when the answer stopped with an error)."""

    def pos(name: str) -> float:
        return calls.index(name) if name in calls else math.inf

    first_step = min(pos("scaler.step"), pos("optimizer.step"))
    if pos("zero_grad") < first_step:
        return (
            "optimizer.zero_grad() ran before the step: it wiped the window's gradient; "
            "clear gradients last"
        )
    if "scaler.step" in calls and pos("update") < pos("scaler.step"):
        return (
            "scaler.update() ran before scaler.step(optimizer): update reads what the step "
            "found (inf or not) and resets it, so it must come after the step"
        )
    unscales = [i for i, c in enumerate(calls) if c == "unscale_"]
    if len(unscales) > 1 and unscales[1] < pos("scaler.step"):
        return (
            f"scaler.unscale_(optimizer) was called {len(unscales)} times; call it exactly "
            "once, after the last backward pass"
        )
    if "scaler.step" not in calls:
        return (
            "step through scaler.step(optimizer), not optimizer.step(): only the scaler skips "
            "the update when a gradient is inf or nan"
        )
    if pos("unscale_") > pos("scaler.step"):
        return (
            "call scaler.unscale_(optimizer) yourself before clipping: without it the clip "
            "sees gradients multiplied by the scale"
        )
    if "update" not in calls:
        return "call scaler.update() after scaler.step(optimizer): it is what moves the scale"
    if calls[-1:] != ["zero_grad"]:
        return "finish with optimizer.zero_grad(): the next window must start from no gradient"
    if calls != EXPECTED:
        return (
            f"the calls ran as {' → '.join(calls)}; the boundary is "
            "unscale_ → clip → scaler.step → update → zero_grad"
        )
    return None


def _clip_problem(norm_at_step: float | None, max_norm: float, true_norm: float) -> str | None:
    """Whether the gradient the optimizer received was clipped, and in which units."""
    if norm_at_step is None:
        return "the optimizer never stepped on a finite window; call scaler.step(optimizer)"
    if abs(norm_at_step - max_norm) <= 1e-3 * max_norm:
        return None
    if abs(norm_at_step - true_norm) <= 1e-3 * true_norm:
        return (
            f"the optimizer got the unclipped gradient (norm {norm_at_step:.3g} > max_norm="
            f"{max_norm:.3g}); clip with torch.nn.utils.clip_grad_norm_(model.parameters(), "
            "max_norm) after unscale_ and before the step"
        )
    if norm_at_step < 0.5 * max_norm:
        return (
            f"the optimizer got a gradient of norm {norm_at_step:.3g}, far below max_norm="
            f"{max_norm:.3g}: it was clipped while still multiplied by the scale; unscale first"
        )
    return f"the optimizer got a gradient of norm {norm_at_step:.3g}, expected max_norm={max_norm:.3g}"


def check_window_boundary(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` ends an fp16 window exactly like the reference (same weights,
    same scale, the calls in order, the gradient clipped to ``max_norm`` in true units, a
    window with an inf gradient skipped), else what is wrong."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    with torch.random.fork_rng(devices=[]):  # leave the notebook's random state alone
        model, window = _case()
        probe, reference = copy.deepcopy(model), copy.deepcopy(model)
        _run(lambda m, o, s, n: s.unscale_(o), probe, window, None, poison=False)
        true_norm = _norm_of(probe)
        max_norm = 0.5 * true_norm  # clipping must bite
        _, ref_scaler, _ = _run(reference_window_boundary, reference, window, max_norm, False)

        log, scaler, error = _run(answer, model, window, max_norm, poison=False)
        problem = _order_problem(log.calls)
        if error is not None:
            return f"your boundary raised {type(error).__name__}: {error}" + (
                f" ({problem})" if problem else ""
            )
        problem = problem or _clip_problem(log.norm_at_step, max_norm, true_norm)
        if problem is not None:
            return problem
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if not torch.allclose(p, q, rtol=RTOL, atol=1e-7):
                return f"after the update {name} differs from the reference boundary"
        if scaler.get_scale() != ref_scaler.get_scale():
            return f"the scale is {scaler.get_scale():g}, expected {ref_scaler.get_scale():g}"
        if any(p.grad is not None and bool(p.grad.any()) for p in model.parameters()):
            return "gradients are left after the boundary; clear them with optimizer.zero_grad()"

        # A window with an inf gradient: nothing may reach the weights, the scale backs off.
        model, window = _case(seed=4)
        before = [p.detach().clone() for p in model.parameters()]
        log, scaler, error = _run(answer, model, window, max_norm, poison=True)
        if error is not None:
            return f"with an inf gradient your boundary raised {type(error).__name__}: {error}"
        if any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)):
            return (
                "with an inf gradient the weights changed: step through scaler.step(optimizer), "
                "which skips the update, never optimizer.step() directly"
            )
        if scaler.get_scale() != 2.0**9:
            return (
                "with an inf gradient the scale should back off from 1024 to 512, got "
                f"{scaler.get_scale():g}; call scaler.update() after the step"
            )
    return None


def _norm_of(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])))


window_boundary = Exercise(
    name="window_boundary",
    checker=check_window_boundary,
    hints=(
        "Five calls: scaler.unscale_(optimizer), torch.nn.utils.clip_grad_norm_(model."
        "parameters(), max_norm), scaler.step(optimizer), scaler.update(), "
        "optimizer.zero_grad().",
        "Clipping compares the gradient norm with max_norm, so it must see the true "
        "gradient: unscale first.",
        "scaler.update() decides the next scale from what scaler.step found, so it comes "
        "after the step; clearing the gradients comes last.",
    ),
    reference=inspect.getsource(reference_window_boundary),
)
