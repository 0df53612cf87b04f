"""The update trace: what each update of the user's loop was made of.

:class:`UpdateTrace` hooks the audit's model, optimizer and scheduler and records, in
order, every forward pass (which example each input row is, and at which weights it ran),
backward pass, ``zero_grad``, ``optimizer.step`` (with the gradient it found: after the
closure, when it was given one), ``scheduler.step``, and every time the accumulated gradient shrank after a backward pass
(a clip, before the next backward pass or before the step); it also keeps a weak
reference to every tensor each window created. :func:`window_changes` says what the loop
changed in its window.

It runs no clock and draws nothing: the course's ``TimelineRecorder``
(:mod:`accumlab_course.plots`) records *when* each step of a window ran, to draw a
time-line; this records *what* reached each update, to fit it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..least_squares import least_squares
from .controlled_set import AUDIT_TOLERANCE, Row, RowKey


def flat(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors as one float64 vector."""
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def flat_grad(params: Sequence[nn.Parameter]) -> Tensor:
    """The parameters' ``.grad`` as one float64 vector (zeros where it is None)."""
    return flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])


def shrink_factor(before: Tensor, now: Tensor) -> float | None:
    """``‖now‖ / ‖before‖`` when ``now`` is ``before`` shrunk as a clip shrinks a gradient
    (scaled by one factor below 1, as ``clip_grad_norm_`` does, or each entry clamped
    towards 0, as ``clip_grad_value_`` does); None when it is not (unchanged, grown,
    cleared to zero, or changed in another way)."""
    norm_before, norm_now = float(before.norm()), float(now.norm())
    if norm_now == 0.0 or not norm_now < norm_before * (1 - AUDIT_TOLERANCE):
        return None
    fit = least_squares(now, [before])
    scaled = fit.residual <= AUDIT_TOLERANCE and fit.coefficients[0] > 0
    clamped = bool(((now.abs() <= before.abs()) & (now * before >= 0)).all())
    return norm_now / norm_before if scaled or clamped else None


@dataclass
class Forward:
    """One forward pass of the loop's model."""

    window: int
    rows: tuple[RowKey | None, ...]  # per input row: the example it is, None when none
    theta: int  # index in UpdateTrace.thetas of the weights the forward pass ran at
    backward: int = 0  # backward passes that went through its output


@dataclass
class Step:
    """One ``optimizer.step()`` call."""

    window: int
    grad: Tensor  # the gradient optimizer.step found (zeros where .grad is None)


class CreatedTensors(TorchDispatchMode):
    """Keeps a weak reference to every tensor an operator creates while it is on and not
    paused (the trace pauses it for its own work)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ReferenceType[Tensor]] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self.refs.append(weakref.ref(t))
        return out


class UpdateTrace:
    """Hooks on the audit's model, optimizer and scheduler: what happened, in order.

    ``events`` holds ``(window, kind, index)`` with ``kind`` one of ``"forward"`` and
    ``"backward"`` (``index`` into ``forwards``), ``"step"`` (into ``steps``),
    ``"shrink"`` (into ``shrinks``: the factor by which the gradient's norm shrank since
    the previous backward pass, as by a clip or a GradScaler's unscale, recorded as the
    next backward pass or step begins), ``"zero_grad"`` and ``"scheduler"`` (``index``
    -1). ``thetas`` holds every set of weights a forward pass
    ran at; ``created`` one :class:`CreatedTensors` per window.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        rows: list[list[Row]],
    ) -> None:
        self.params = list(model.parameters())
        self.rows = rows
        self.window = -1
        self.events: list[tuple[int, str, int]] = []
        self.forwards: list[Forward] = []
        self.steps: list[Step] = []
        self.shrinks: list[float] = []
        self.thetas: list[Tensor] = []
        self.created: list[CreatedTensors] = []
        # each parameter's .grad right after the latest backward pass reached it
        self._accumulated: dict[int, Tensor] = {}
        model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        model.register_forward_hook(self._post_forward)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._after_backward, i))
        optimizer.register_step_pre_hook(self._pre_step)
        for owner in (model, optimizer):
            owner.zero_grad = self._counting(owner.zero_grad, "zero_grad")  # type: ignore[method-assign]
        scheduler.step = self._counting(scheduler.step, "scheduler")

    def begin(self, index: int) -> CreatedTensors:
        """Start window ``index``: returns the mode to run the loop's window under."""
        self.window = index
        self.created.append(CreatedTensors())
        return self.created[-1]

    def theta_index(self, theta: Tensor) -> int:
        """The index of weights ``theta`` in ``thetas`` (appended when new)."""
        for j in range(len(self.thetas) - 1, -1, -1):
            if torch.equal(self.thetas[j], theta):
                return j
        self.thetas.append(theta)
        return len(self.thetas) - 1

    @contextlib.contextmanager
    def _unrecorded(self) -> Iterator[None]:
        """The trace's own tensors are not the loop's: pause the window's mode."""
        mode = self.created[-1]
        mode.paused = True
        try:
            yield
        finally:
            mode.paused = False

    def _event(self, kind: str, index: int = -1) -> None:
        self.events.append((self.window, kind, index))

    def _counting(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._event(kind)
            if kind == "zero_grad":
                self._accumulated.clear()  # a clear after a backward pass is no shrink
            return fn(*args, **kwargs)

        return counted

    def _match(self, ids: object) -> tuple[RowKey | None, ...]:
        """Which example of the current window each input row is: its real tokens first,
        then anything (padding); the longest such example wins."""
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            return (None,)
        ids = ids.detach().cpu()
        found: list[RowKey | None] = []
        for row in ids:
            best: Row | None = None
            for example in self.rows[self.window]:
                n = example.tokens.numel()
                if n <= row.numel() and torch.equal(row[:n], example.tokens):
                    if best is None or n > best.tokens.numel():
                        best = example
            found.append(best.key if best is not None else None)
        return tuple(found)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        with self._unrecorded():
            rows = self._match(kwargs.get("input_ids", args[0] if args else None))
            theta = self.theta_index(flat(self.params))
        self.forwards.append(Forward(self.window, rows, theta))
        self._event("forward", len(self.forwards) - 1)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        logits = getattr(output, "logits", output)
        index = len(self.forwards) - 1
        if isinstance(logits, Tensor) and logits.requires_grad:

            def backward_seen(grad: Tensor) -> None:
                # The logits' gradient comes before any parameter's in this backward pass:
                # .grad still holds what the previous one left, or what was done to it since.
                self._shrunk_since_backward()
                self.forwards[index].backward += 1
                self._event("backward", index)

            logits.register_hook(backward_seen)

    def _after_backward(self, i: int, param: Tensor) -> None:
        if param.grad is not None:
            with self._unrecorded():
                self._accumulated[i] = param.grad.detach().clone()

    def _shrunk_since_backward(self) -> None:
        """Record a ``"shrink"`` when the gradient the previous backward pass left has
        shrunk since."""
        if not self._accumulated:
            return
        with self._unrecorded():
            order = sorted(self._accumulated)
            before = flat([self._accumulated[i] for i in order])
            now = flat_grad([self.params[i] for i in order])
            self._accumulated.clear()
            factor = shrink_factor(before, now)
        if factor is not None:
            self.shrinks.append(factor)
            self._event("shrink", len(self.shrinks) - 1)

    def _record_step(self) -> None:
        self._shrunk_since_backward()
        with self._unrecorded():
            self.steps.append(Step(self.window, flat_grad(self.params)))
        self._event("step", len(self.steps) - 1)

    def _pre_step(
        self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        """Record the step's gradient now, or, when ``step`` was given a closure, once the
        closure has run: the optimizer applies what the closure's backward passes leave
        (Lightning runs a window's last microbatch in it; an LBFGS loop its whole window)."""
        # ``args`` starts with the optimizer itself: step(self, closure=None)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._record_step()
            return None
        calls = 0

        def traced_closure() -> Any:
            nonlocal calls
            out = closure()
            calls += 1
            if calls == 1:
                self._record_step()
            else:  # a closure re-evaluated inside one step (LBFGS): its latest gradient
                self._shrunk_since_backward()
                with self._unrecorded():
                    self.steps[-1].grad = flat_grad(self.params)
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": traced_closure}
        return (args[0], traced_closure, *args[2:]), kwargs


def window_changes(
    k: int, window: Sequence[Mapping[str, Tensor]], held: Sequence[Mapping[str, Any]]
) -> list[str]:
    """What the loop changed in window ``k`` it was given (tensors edited in place or
    entries replaced), one phrase each."""
    out = []
    for i, (original, given) in enumerate(zip(window, held, strict=True)):
        for key, before in original.items():
            after = given.get(key)
            if (
                isinstance(after, Tensor)
                and after.shape == before.shape
                and torch.equal(after, before)
            ):
                continue
            how = "replaced or removed"
            if isinstance(after, Tensor) and after.shape == before.shape:
                how = "edited in place"
                if before.dim() == 2 and torch.equal(after[:, :-1], before[:, 1:]):
                    how = "shifted one position left in place"
            out.append(f"{key} of microbatch {i} of window {k} ({how})")
    return out
