"""Exercises for notebook 03 (mixed precision and the GradScaler).

- ``amp_microbatch``: write the microbatch side of an fp16 window,
  ``amp_microbatch(model, microbatch, objective, window_count, scaler) -> None``: run the
  forward and the loss under ``torch.autocast(device_type="cpu", dtype=torch.float16)``,
  divide the microbatch's ``loss_sum`` by the window's count, and backpropagate the loss
  multiplied by the scaler's scale. The checker calls it for each microbatch of a window
  of unequal microbatches, unscales once and compares the gradient with the reference;
  it names the usual mistakes: no autocast (or bf16), backward on the unscaled loss,
  the microbatch's own mean (the average of averages), no division, the boundary's calls
  (``unscale_``, ``step``, ``update``) made per microbatch, earlier gradients cleared.
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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...checks import compare, inject_nonfinite
from ...loop import accumulate
from ...objectives import ExampleLoss
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

    def scale(self, outputs: Any) -> Any:
        self.log.calls.append("scale")
        return super().scale(outputs)

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
    except NotImplementedError:
        raise  # a stub: check() reports "not attempted yet"
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
    return (
        f"the optimizer got a gradient of norm {norm_at_step:.3g}, expected max_norm={max_norm:.3g}"
    )


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


# ----------------------------------------------------------------------------- amp_microbatch


def reference_amp_microbatch(model, microbatch, objective, window_count, scaler):
    """Forward and backward of one microbatch of an fp16 window."""
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        output = model(microbatch["x"])  # matrix products in fp16, weights stay float32
        loss = objective.loss_sum(output, microbatch) / window_count  # the window's count
    scaler.scale(loss).backward()  # S × the gradient lands in .grad; unscale_ at the boundary


#: Relative tolerance on the unscaled window gradient: the answer does the same fp16 math.
AMP_RTOL = 1e-3


def _amp_case() -> tuple[nn.Module, list[dict[str, Tensor]]]:
    """A fresh MLP and a window of three microbatches of 2, 3 and 4 examples."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 6, generator=g)
    labels = torch.randint(0, 3, (9,), generator=g)
    torch.manual_seed(7)
    bounds = [(0, 2), (2, 5), (5, 9)]
    return MLP(6, 12, 3), [{"x": x[a:b], "labels": labels[a:b]} for a, b in bounds]


@dataclass
class _AmpRun:
    """What one run of an ``amp_microbatch`` answer left: the unscaled window gradient
    (None if no backward reached the weights), the boundary calls the scaler saw, how
    often it scaled a loss, the dtypes the first layer produced, and the scale."""

    grads: dict[str, Tensor] | None
    calls: list[str]
    scaled: int
    dtypes: set[torch.dtype]
    scale: float
    error: str | None = None


def _amp_run(answer: Callable[..., Any]) -> _AmpRun:
    """Call ``answer`` for every microbatch of the case's window with a recording scaler,
    then unscale once (unless the answer already did)."""
    model, window = _amp_case()
    log = _Log()
    scaler = _RecordingScaler(log)
    dtypes: set[torch.dtype] = set()
    model.net[0].register_forward_hook(lambda m, i, out: dtypes.add(out.dtype))
    objective = ExampleLoss()
    total = sum(objective.count(mb) for mb in window)
    error = None
    try:
        for mb in window:
            answer(model, mb, objective, total, scaler)
    except NotImplementedError:
        raise  # a stub: check() reports "not attempted yet"
    except Exception as exc:  # reported after the calls it made, which explain it better
        error = f"{type(exc).__name__}: {exc}"
    calls = list(log.calls)  # the answer's calls only
    if error or all(p.grad is None for p in model.parameters()) or "scale" not in calls:
        grads = None if error else _grads(model)
        return _AmpRun(grads, calls, calls.count("scale"), dtypes, scaler.get_scale(), error)
    if "unscale_" not in calls:
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    return _AmpRun(_grads(model), calls, calls.count("scale"), dtypes, scaler.get_scale())


def _grads(model: nn.Module) -> dict[str, Tensor] | None:
    if all(p.grad is None for p in model.parameters()):
        return None
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
    }


def _mean_per_microbatch(model, microbatch, objective, window_count, scaler):
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = objective.loss_sum(model(microbatch["x"]), microbatch) / objective.count(microbatch)
    scaler.scale(loss / 3).backward()


def _no_division(model, microbatch, objective, window_count, scaler):
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = objective.loss_sum(model(microbatch["x"]), microbatch)
    scaler.scale(loss).backward()


def check_amp_microbatch(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` leaves the reference's scaled gradient after the window, else
    what is wrong."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    with torch.random.fork_rng(devices=[]):
        reference_run = _amp_run(reference_amp_microbatch)
        reference, scale = reference_run.grads, reference_run.scale
        run = _amp_run(answer)
        got, dtypes = run.grads, run.dtypes
        boundary = [c for c in run.calls if c in ("unscale_", "scaler.step", "update")]
        if boundary:
            return (
                f"the answer called {', '.join(sorted(set(boundary)))} inside the microbatch; "
                "unscale_, step and update belong to the boundary, once after the last "
                "microbatch (the scale must stay the same for the whole window)"
            )
        if run.error is not None:
            return f"your answer raised {run.error}"
        if torch.float32 in dtypes or not dtypes:
            return (
                "the forward ran in float32: put the forward and the loss inside "
                'torch.autocast(device_type="cpu", dtype=torch.float16)'
            )
        if torch.float16 not in dtypes:
            return (
                f"the forward ran in {sorted(map(str, dtypes))}; this window is fp16, the type "
                "that needs the GradScaler: dtype=torch.float16"
            )
        if got is None:
            return "no gradient reached the weights: call .backward() on the scaled loss"
        if run.scaled == 0:
            return (
                "the loss was never passed through scaler.scale(loss): without it small fp16 "
                "gradients underflow to zero, and unscale_ at the boundary divides by S anyway"
            )
        if compare(reference, got).ok(AMP_RTOL):
            return None
        unscaled = {k: v * scale for k, v in got.items()}
        if compare(reference, unscaled).ok(AMP_RTOL):
            return (
                "the gradient is 1/S of the reference: call .backward() on scaler.scale(loss), "
                "not on the loss itself"
            )
        for wrong, message in (
            (
                _mean_per_microbatch,
                "each microbatch was divided by its own count: the average "
                "of averages; divide every loss_sum by window_count, the window's total",
            ),
            (
                _no_division,
                "the loss_sum was not divided: divide it by window_count, the window's total count",
            ),
        ):
            if compare(_amp_run(wrong).grads, got).ok(AMP_RTOL):
                return message
        model, window = _amp_case()
        total = sum(ExampleLoss().count(mb) for mb in window)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        reference_amp_microbatch(model, window[-1], ExampleLoss(), total, scaler)
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
        if compare(gradients_of(model), got).ok(AMP_RTOL):
            return (
                "only the last microbatch's gradient is left: earlier ones were cleared "
                "(no zero_grad inside a microbatch; the window adds into .grad)"
            )
        return (
            f"the unscaled window gradient differs from the reference (max relative error "
            f"{compare(reference, got).max_rel_error:.2g})"
        )


def gradients_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


amp_microbatch = Exercise(
    name="amp_microbatch",
    checker=check_amp_microbatch,
    hints=(
        'with torch.autocast(device_type="cpu", dtype=torch.float16): compute '
        'output = model(microbatch["x"]) and the loss inside the block.',
        "The loss of one microbatch is objective.loss_sum(output, microbatch) / window_count: "
        "the window's count, so the microbatches add up to the window's mean.",
        "Backpropagate scaler.scale(loss), outside or inside autocast (both work); nothing "
        "else: unscale_, step and update wait for the boundary.",
    ),
    reference=inspect.getsource(reference_amp_microbatch),
)
