"""Watching the user's loop: hooks on the audit's model, optimizer and scheduler that
record every forward pass (and the example of each input row), backward pass,
``zero_grad``, ``optimizer.step`` (with the gradient it found) and ``scheduler.step``, in
order; the tensors each window created; and what the loop changed in its window."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .controlled_set import RowKey, _Row


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def _flat_grad(params: Sequence[nn.Parameter]) -> Tensor:
    return _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])


@dataclass
class _Forward:
    window: int
    rows: tuple[RowKey | None, ...]  # per input row: the example it is, None when none
    theta: int  # index in _Watch.thetas of the weights the forward pass ran at
    backward: int = 0  # backward passes that went through its output


@dataclass
class _Step:
    window: int
    grad: Tensor  # the gradient optimizer.step found (zeros where .grad is None)


class _Created(TorchDispatchMode):
    """Keeps a weak reference to every tensor an operator creates while it is on."""

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


class _Watch:
    """Hooks on the audit's model, optimizer and scheduler: what happened, in order."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        rows: list[list[_Row]],
    ) -> None:
        self.params = list(model.parameters())
        self.rows = rows
        self.window = -1
        self.events: list[tuple[int, str, int]] = []  # (window, kind, index)
        self.forwards: list[_Forward] = []
        self.steps: list[_Step] = []
        self.thetas: list[Tensor] = []
        self.created: list[_Created] = []
        model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        model.register_forward_hook(self._post_forward)
        optimizer.register_step_pre_hook(self._pre_step)
        for owner in (model, optimizer):
            owner.zero_grad = self._counting(owner.zero_grad, "zero_grad")  # type: ignore[method-assign]
        scheduler.step = self._counting(scheduler.step, "scheduler")

    @property
    def mode(self) -> _Created:
        return self.created[-1]

    def begin(self, index: int) -> _Created:
        self.window = index
        self.created.append(_Created())
        return self.mode

    def theta_index(self, theta: Tensor) -> int:
        """The index of weights ``theta`` in ``thetas`` (appended when new)."""
        for j in range(len(self.thetas) - 1, -1, -1):
            if torch.equal(self.thetas[j], theta):
                return j
        self.thetas.append(theta)
        return len(self.thetas) - 1

    def _event(self, kind: str, index: int = -1) -> None:
        self.events.append((self.window, kind, index))

    def _counting(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._event(kind)
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
            best: _Row | None = None
            for example in self.rows[self.window]:
                n = example.tokens.numel()
                if n <= row.numel() and torch.equal(row[:n], example.tokens):
                    if best is None or n > best.tokens.numel():
                        best = example
            found.append(best.key if best is not None else None)
        return tuple(found)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.mode.paused = True
        try:
            rows = self._match(kwargs.get("input_ids", args[0] if args else None))
            theta = self.theta_index(_flat(self.params))
        finally:
            self.mode.paused = False
        self.forwards.append(_Forward(self.window, rows, theta))
        self._event("forward", len(self.forwards) - 1)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        logits = getattr(output, "logits", output)
        index = len(self.forwards) - 1
        if isinstance(logits, Tensor) and logits.requires_grad:

            def backward_seen(grad: Tensor) -> None:
                self.forwards[index].backward += 1
                self._event("backward", index)

            logits.register_hook(backward_seen)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.mode.paused = True
        try:
            self.steps.append(_Step(self.window, _flat_grad(self.params)))
        finally:
            self.mode.paused = False
        self._event("step", len(self.steps) - 1)


def _changes(
    k: int, window: Sequence[Mapping[str, Tensor]], held: Sequence[Mapping[str, Any]]
) -> list[str]:
    """What the loop changed in the window it was given (tensors edited in place or
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
