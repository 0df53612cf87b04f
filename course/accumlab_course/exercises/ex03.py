"""Exercises for notebook 03 (mixed precision and the GradScaler).

- ``window_boundary``: write the end of an fp16 accumulation window,
  ``window_boundary(model, optimizer, scaler, max_norm) -> tuple[bool, float]``. When it is
  called, every microbatch of the window has already backpropagated ``scaler.scale(loss)``,
  so each ``.grad`` holds the window's gradient multiplied by the scale. Unscale once and
  measure the total norm of the true gradient; when it is finite, clip the combined
  gradient to ``max_norm`` and step through the scaler; when it is not, neither clip nor
  step (the time-line of a skipped window in notebook 03); in both cases update the scale
  and clear the gradients. Return ``(applied, norm)``: whether ``optimizer.step()`` ran
  and the norm before clipping (a float; inf or nan when a gradient entry is).

  The checker runs the answer on a fresh MLP whose window was accumulated under fp16
  autocast with a recording GradScaler and optimizer: with finite gradients, with an inf
  injected into one gradient, and with a scale below 1 (``init_scale=2**-4``) and a finite
  scaled gradient that overflows to inf only when unscaled, which the scaler does not
  notice (``scaler.step`` alone would step on it). It judges the state the boundary
  leaves, never the calls it makes: the weights after the update, the scale (the checker's
  scaler grows it after every finite window, so a missing ``update()`` shows), every
  gradient cleared (``None`` or zero, through the optimizer, the model or by hand) and the
  returned pair. When the state is wrong, the recorded calls name the usual mistake:
  clipping before unscaling (the clip then sees gradients multiplied by the scale),
  stepping the optimizer directly (an inf gradient then reaches the weights), updating the
  scale before the step, clearing the gradients too early, unscaling twice, the norm
  measured before ``unscale_`` or after the clip, ``applied`` taken from ``scaler.step``'s
  return value (what ``optimizer.step()`` returned when it stepped, ``None`` for SGD
  without a closure, and ``None`` when it skipped).
- ``scale_schedule`` (transfer): ``scale_schedule(nonfinite, init_scale, growth_interval)
  -> list[float]``, the scale each window's microbatches are multiplied by, for windows
  whose unscaled gradient is non-finite where ``nonfinite[i]`` is True, under GradScaler's
  rules (×2 after ``growth_interval`` applied updates in a row, ×0.5 after a skipped one).
  The checker compares with a real ``torch.amp.GradScaler`` driven through the same windows.
- Predict first: ``cpu_softmax_dtype`` (the dtype of a softmax under CPU bf16 autocast),
  ``fp16_of_4e_8`` (what 4e-8 becomes in fp16), ``adamw_steps_after_skip`` (AdamW's step
  count after three windows, the middle one skipped).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from accumlab.checks import inject_nonfinite
from accumlab.loop import accumulate
from accumlab.objectives import ExampleLoss

from ..models import MLP
from . import Exercise
from .predictions import choice_prediction, number_prediction

#: Relative tolerance on the weights after the update: both runs do the same float32 math.
RTOL = 1e-5
#: A scale below 1: unscaling multiplies, so a finite scaled gradient can overflow.
SMALL_SCALE = 2.0**-4
#: The checker's scale and growth interval: with 1, every window without an inf doubles
#: the scale, so a boundary that forgets ``scaler.update()`` leaves a visible difference.
START_SCALE, GROWTH_INTERVAL = 2.0**10, 1


def reference_window_boundary(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    max_norm: float,
) -> tuple[bool, float]:
    """The end of an fp16 window; returns (applied, the true gradient's norm before
    clipping)."""
    scaler.unscale_(optimizer)  # once, after the last backward: now the true gradient
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)  # inf or nan when any entry is
    applied = math.isfinite(norm)
    if applied:  # a non-finite gradient is neither clipped nor stepped on
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
        scaler.step(optimizer)
    scaler.update()  # grows the scale, or backs it off after an inf it found
    optimizer.zero_grad(set_to_none=True)  # the next window starts from nothing
    return applied, float(norm)


class _Log:
    """What the recording scaler and optimizer saw, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.norm_at_step: float | None = None
        self.returned: Any = None


class _RecordingScaler(torch.amp.GradScaler):
    def __init__(self, log: _Log, init_scale: float = START_SCALE) -> None:
        super().__init__("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
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
    overflow: bool = False,
) -> tuple[_Log, _RecordingScaler, Exception | None]:
    """Accumulate the window under fp16 with a recording scaler, then call ``answer``.

    ``poison`` injects an inf into one gradient. ``overflow`` runs at the scale
    :data:`SMALL_SCALE` and sets one scaled gradient entry to a finite value that
    unscaling (× 1 / scale) turns into inf: ``unscale_`` checks the entries before it
    divides, so the scaler records no inf."""
    log = _Log()
    scaler = _RecordingScaler(log, SMALL_SCALE if overflow else START_SCALE)
    optimizer = _RecordingSGD(model.parameters(), log)
    optimizer.zero_grad(set_to_none=True)
    guard = inject_nonfinite(next(model.parameters())) if poison else contextlib.nullcontext()
    with guard:
        accumulate(model, window, ExampleLoss(), precision="fp16", scaler=scaler)
    if overflow:
        first = next(model.parameters()).grad
        first.view(-1)[0] = torch.finfo(torch.float32).max * SMALL_SCALE * 2  # finite
    log.calls.clear()  # only the boundary counts
    try:
        log.returned = answer(model, optimizer, scaler, max_norm)
    except NotImplementedError:
        raise  # a stub: check() reports "not attempted yet"
    except Exception as exc:  # report what the learner's order made PyTorch say
        return log, scaler, exc
    return log, scaler, None


def _order_problem(calls: list[str]) -> str | None:
    """What the recorded scaler and optimizer calls show went wrong, when the state an
    answer left (or the error it raised) says something did. Never a verdict on its own:
    a boundary that leaves the right state passes whatever its calls."""

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
    if pos("unscale_") > first_step:
        return (
            "call scaler.unscale_(optimizer) yourself before clipping: without it the clip "
            "sees gradients multiplied by the scale"
        )
    return None


def _clip_problem(norm_at_step: float | None, max_norm: float, true_norm: float) -> str | None:
    """Whether the gradient the optimizer received was clipped, and in which units."""
    if norm_at_step is None:
        return "the optimizer never stepped on a finite window; call scaler.step(optimizer)"
    if norm_at_step == 0.0:
        return (
            "the optimizer stepped with no gradient: it was cleared before the step; clear "
            "gradients last"
        )
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


def _gradients_left(model: nn.Module) -> bool:
    """Whether any ``.grad`` still holds a nonzero entry (None and zeros are both cleared)."""
    return any(p.grad is not None and bool(p.grad.any()) for p in model.parameters())


def _raised(where: str, error: Exception, log: _Log) -> str:
    problem = _order_problem(log.calls)
    return f"{where}your boundary raised {type(error).__name__}: {error}" + (
        f" ({problem})" if problem else ""
    )


def check_window_boundary(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` leaves an fp16 window's boundary in the reference's state, else
    what is wrong. The state is judged, not the calls: the weights after the update, the
    scale, the gradients cleared (``None`` or zero, however they were cleared) and the
    returned ``(applied, norm)``, on a finite window (the gradient clipped to ``max_norm`` in
    true units), a window with an inf gradient and one that overflows only when unscaled
    (nothing applied, the scale updated). The recorded calls only explain a wrong state."""
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
        if error is not None:
            return _raised("", error, log)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if not torch.allclose(p, q, rtol=RTOL, atol=1e-7):
                return (
                    _order_problem(log.calls)
                    or _clip_problem(log.norm_at_step, max_norm, true_norm)
                    or f"after the update {name} differs from the reference boundary"
                )
        if scaler.get_scale() != ref_scaler.get_scale():
            return (
                f"the scale is {scaler.get_scale():g} after a finite window, expected "
                f"{ref_scaler.get_scale():g}: call scaler.update() after the step, every window"
            )
        if _gradients_left(model):
            return (
                "gradients are left after the boundary: clear them after the step "
                "(optimizer.zero_grad()), so the next window starts from no gradient"
            )
        problem = _returned_problem(log.returned, True, true_norm, START_SCALE, max_norm)
        if problem is not None:
            return problem

        # A window with an inf gradient: nothing may reach the weights, the scale backs off.
        model, window = _case(seed=4)
        before = [p.detach().clone() for p in model.parameters()]
        log, scaler, error = _run(answer, model, window, max_norm, poison=True)
        if error is not None:
            return _raised("with an inf gradient ", error, log)
        if any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)):
            return (
                "with an inf gradient the weights changed: step through scaler.step(optimizer), "
                "which skips the update, or let the norm decide; never optimizer.step() "
                "directly on every window"
            )
        if scaler.get_scale() != START_SCALE / 2:
            return (
                f"with an inf gradient the scale should back off from {START_SCALE:g} to "
                f"{START_SCALE / 2:g}, got {scaler.get_scale():g}; call scaler.update() after "
                "the step"
            )
        if _gradients_left(model):
            return "with an inf gradient gradients are left; clear them every window"
        problem = _returned_problem(log.returned, False, math.inf, START_SCALE, max_norm)
        if problem is not None:
            return problem

        # A scale below 1: a finite scaled entry overflows when unscaled, the scaler
        # records no inf, and only the norm shows it.
        model, window = _case(seed=5)
        before = [p.detach().clone() for p in model.parameters()]
        log, scaler, error = _run(answer, model, window, max_norm, poison=False, overflow=True)
        where = (
            f"at scale {SMALL_SCALE:g} with a gradient that overflows to inf only when "
            "unscaled"
        )
        if error is not None:
            return _raised(f"{where} ", error, log)
        if any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)):
            return (
                f"{where}, the weights changed: unscale_ checks the entries before it "
                "divides, so the scaler found no inf and scaler.step stepped; decide from "
                "the norm, and when it is not finite call neither the clip nor the step"
            )
        if scaler.get_scale() == SMALL_SCALE:
            return f"{where} the scale did not move: call scaler.update() every window"
        if _gradients_left(model):
            return f"{where} gradients are left; clear them after the step"
        return _returned_problem(log.returned, False, math.inf, SMALL_SCALE, max_norm)


def _returned_problem(
    returned: Any, applied: bool, true_norm: float, scale: float, max_norm: float
) -> str | None:
    """What is wrong with the ``(applied, norm)`` an answer returned, or None."""
    where = "on a finite window" if applied else "on a window with an inf gradient"
    if not isinstance(returned, tuple) or len(returned) != 2:
        return (
            f"return (applied, norm), a bool and a float; got {returned!r} {where}: whether "
            "the update was applied and the true gradient's norm before clipping"
        )
    got_applied, norm = returned
    try:
        norm = float(norm)
    except (TypeError, ValueError):
        return f"norm must be a float (or a 0-d tensor), got {type(norm).__name__}"
    if got_applied is None:
        return (
            "applied is None: scaler.step(optimizer) returns what optimizer.step() returned "
            "when it steps (None for SGD without a closure) and None when it skips, so it "
            "cannot tell; decide from the norm: math.isfinite(norm)"
        )
    if bool(got_applied) != applied:
        if applied:
            return f"applied is {got_applied!r} {where}: the update was applied"
        return (
            f"applied is {got_applied!r} {where}: the update must be skipped; the norm "
            "of a gradient with an inf or nan entry is not finite, math.isfinite(norm) says so"
        )
    if applied:
        if math.isclose(norm, true_norm * scale, rel_tol=1e-3):
            return (
                f"the norm {norm:.4g} is the scale ({scale:g}) times the true norm: measure it "
                "after scaler.unscale_(optimizer)"
            )
        if math.isclose(norm, max_norm, rel_tol=1e-3):
            return (
                f"the norm {norm:.4g} is max_norm: it was measured after clipping; "
                "clip_grad_norm_ returns the norm before it clipped"
            )
        if not math.isclose(norm, true_norm, rel_tol=1e-4):
            return f"the norm is {norm:.6g}, expected the true gradient's {true_norm:.6g}"
    elif math.isfinite(norm):
        return f"the norm is {norm:.4g} {where}; the gradient's norm is inf or nan there"
    return None


def _norm_of(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])))


window_boundary = Exercise(
    name="window_boundary",
    checker=check_window_boundary,
    hints=(
        "Clipping compares the gradient norm with max_norm, so it must see the true "
        "gradient: scaler.unscale_(optimizer) first, once.",
        "Measure the norm before clipping: torch.nn.utils.get_total_norm(grads) over the "
        "existing .grad tensors. It is finite exactly when every entry is, also when "
        "unscaling itself overflowed (which the scaler does not see when the scale is "
        "below 1).",
        "Finite: torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm), "
        "then scaler.step(optimizer). Not finite: neither. Always scaler.update() and "
        "optimizer.zero_grad(); return (math.isfinite(norm), norm).",
    ),
    reference=inspect.getsource(reference_window_boundary),
)


# ----------------------------------------------------------------------------- scale_schedule


def reference_scale_schedule(nonfinite, init_scale, growth_interval):
    """The scale each window's microbatches are multiplied by, window after window."""
    scale, in_a_row, used = init_scale, 0, []
    for inf in nonfinite:
        used.append(scale)  # one scale for the whole window, changed only in update()
        if inf:  # skipped: back off, and the count of applied updates starts again
            scale, in_a_row = scale * 0.5, 0
        else:
            in_a_row += 1
            if in_a_row == growth_interval:  # that many applied updates in a row: grow
                scale, in_a_row = scale * 2.0, 0
    return used


def real_scale_schedule(
    nonfinite: Sequence[bool], init_scale: float, growth_interval: int
) -> list[float]:
    """What a real ``torch.amp.GradScaler("cpu")`` does: one weight, one microbatch per
    window, an inf injected into the windows marked True; the scale each window used."""
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    used = []
    for inf in nonfinite:
        used.append(float(scaler.get_scale()))
        with inject_nonfinite(weight) if inf else contextlib.nullcontext():
            scaler.scale(weight.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return used


def _schedule_cases() -> list[tuple[list[bool], float, int]]:
    cases = [
        ([False] * 5, 1024.0, 2),
        ([False, False, True, False, False, False], 2.0**16, 2),
        ([True, True, False, False, False], 256.0, 3),
        ([False, True, False, True, False, False, False, False], 8.0, 2),
        ([False] * 4, 64.0, 1),
    ]
    rng = random.Random(3)
    for _ in range(12):
        n = rng.randint(1, 12)
        cases.append(
            ([rng.random() < 0.3 for _ in range(n)], 2.0 ** rng.randint(3, 16), rng.randint(1, 4))
        )
    return cases


def _scale_after(nonfinite, init_scale, growth_interval):
    return reference_scale_schedule([*nonfinite, False], init_scale, growth_interval)[1:]


def _never_reset(nonfinite, init_scale, growth_interval):
    scale, good, used = init_scale, 0, []
    for inf in nonfinite:
        used.append(scale)
        if inf:
            scale *= 0.5
        else:
            good += 1
            if good % growth_interval == 0:
                scale *= 2.0
    return used


def _grows_every_window(nonfinite, init_scale, growth_interval):
    scale, good, used = init_scale, 0, []
    for inf in nonfinite:
        used.append(scale)
        if inf:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good >= growth_interval:
                scale *= 2.0
    return used


_SCHEDULE_MISTAKES = (
    (
        _scale_after,
        "each value is the scale after that window's update(); the question is the scale "
        "its microbatches were multiplied by, the one before",
    ),
    (
        _never_reset,
        "a skipped window resets GradScaler's count of applied updates in a row: growth "
        "needs growth_interval applied updates after the last skip",
    ),
    (
        _grows_every_window,
        "after the scale grows, the count of applied updates starts again from zero; it "
        "does not grow again at the next window",
    ),
)


def check_scale_schedule(answer: Callable[..., Any]) -> str | None:
    """None when ``answer`` gives a real GradScaler's scale for every window of every case,
    else what is wrong (the usual mistake named when it is recognised)."""
    if not callable(answer):
        return f"expected a function, got {type(answer).__name__}"
    for nonfinite, init_scale, growth_interval in _schedule_cases():
        expected = real_scale_schedule(nonfinite, init_scale, growth_interval)
        got = answer(list(nonfinite), init_scale, growth_interval)
        where = (
            f"for nonfinite={[int(x) for x in nonfinite]}, init_scale={init_scale:g}, "
            f"growth_interval={growth_interval}"
        )
        try:
            got = [float(x) for x in got]
        except TypeError:
            return f"{where}: return a list of floats, one scale per window; got {got!r}"
        if got == expected:
            continue
        if len(got) != len(expected):
            return f"{where}: expected one scale per window ({len(expected)}), got {len(got)}"
        for wrong, meaning in _SCHEDULE_MISTAKES:
            if got == wrong(list(nonfinite), init_scale, growth_interval):
                return f"{where}: {meaning}"
        return f"{where}: expected {[f'{x:g}' for x in expected]}, got {[f'{x:g}' for x in got]}"
    return None


scale_schedule = Exercise(
    name="scale_schedule",
    checker=check_scale_schedule,
    hints=(
        "Walk through the windows keeping two numbers: the current scale and how many "
        "applied updates in a row there have been. Record the scale before changing it.",
        "A window with nonfinite True halves the scale and sets the count to 0.",
        "Any other window adds 1 to the count; when the count reaches growth_interval the "
        "scale doubles and the count goes back to 0.",
    ),
    reference=inspect.getsource(reference_scale_schedule),
)


# ----------------------------------------------------------------------------- predict first

cpu_softmax_dtype = choice_prediction(
    __name__,
    "cpu_softmax_dtype",
    "torch.bfloat16",
    choices=("torch.float32", "torch.bfloat16"),
    mistakes={
        "torch.float32": "that is CUDA autocast's rule (softmax runs in float32 there); CPU "
        "autocast has its own, shorter list and leaves softmax in bf16",
    },
    hints=("The lists of operations autocast changes differ between CUDA and CPU.",),
    reasoning="CPU autocast casts matrix products to bf16 and promotes a few operations "
    "(cross_entropy among them) to float32, but leaves softmax and layer norm of a 16-bit "
    "input in 16 bits. CUDA autocast has other lists: it runs softmax, layer norm and the "
    "loss in float32 (PyTorch's autocast documentation lists the operations per device). A "
    "model that relies on a float32 softmax gets one on a GPU, not on a CPU.",
)

#: 2**-24, fp16's smallest value above zero: what 4e-8 rounds to.
FP16_OF_4E_8 = 2.0**-24

fp16_of_4e_8 = number_prediction(
    __name__,
    "fp16_of_4e_8",
    FP16_OF_4E_8,
    what="float(torch.tensor(4e-8).half()), 6 significant digits are enough",
    mistakes={
        0: "what happens below about 3e-8 (half of the smallest subnormal); 4e-8 is nearer "
        "to 5.96e-8 than to 0, and fp16 rounds to the nearest value",
        4e-8: "not an fp16 value: between 0 and 5.96e-8 fp16 has nothing",
    },
    hints=(
        "fp16's smallest value above zero is 2**-24 ≈ 5.96e-8, and a cast rounds to the nearest.",
    ),
    reasoning="A cast rounds to the nearest fp16 value. Below 2**-25 ≈ 2.98e-8, half of the "
    "smallest subnormal, a value becomes 0; from there up to 2**-24 ≈ 5.96e-8 it rounds up to "
    "2**-24, the smallest subnormal.",
)

#: AdamW's step count after three windows with the middle one skipped (notebook 03 §5).
ADAMW_STEPS_AFTER_SKIP = 2

adamw_steps_after_skip = number_prediction(
    __name__,
    "adamw_steps_after_skip",
    ADAMW_STEPS_AFTER_SKIP,
    what="AdamW's step count after three fp16 windows, the middle one with an inf gradient",
    mistakes={
        3: "the number of update attempts; a skipped attempt makes no optimizer.step() call, "
        "so AdamW's count does not move",
        1: "only the first window; the third one applies normally",
    },
    hints=("scaler.step(optimizer) calls optimizer.step() only when the gradient is finite.",),
    reasoning="Windows 0 and 2 apply an update (optimizer.step() runs), window 1 is skipped: "
    "AdamW's step count is 2 while the ledger counts 3 attempts. The skipped window left "
    "AdamW's state as it was and halved the scale. The scheduler follows applied updates "
    "(al.train_window's scheduler_per=\"applied\"): window 2 runs at the learning rate of "
    "the second applied update; a loop that steps the scheduler at every boundary runs one "
    "update ahead per skip.",
)

__all__ = [
    "adamw_steps_after_skip",
    "cpu_softmax_dtype",
    "fp16_of_4e_8",
    "real_scale_schedule",
    "reference_scale_schedule",
    "reference_window_boundary",
    "scale_schedule",
    "window_boundary",
]
