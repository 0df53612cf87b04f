"""Record what a Hugging Face ``Trainer`` trains on and the gradient it would apply.

A :class:`WindowRecorder` is the audit's eye inside the Trainer's own training path. Its
internal API (used by :func:`accumlab.hf.audit_trainer` and by a Trainer callback):

- ``recorder.install(trainer)`` wraps ``trainer.training_step`` (on the instance, so a
  subclass's override still runs) to record each microbatch the Trainer trains on: the
  ``inputs`` mapping as handed to ``training_step`` (tensors cloned, before the Trainer
  moves them to its device), ``num_items_in_batch`` as the Trainer computed it, and the
  torch RNG state at entry (so the reference forward pass can replay the same dropout
  masks). It also wraps ``trainer.accelerator.clip_grad_norm_`` so the window's gradient
  is taken *before* clipping. ``recorder.remove()`` undoes both; ``install`` is also a
  context manager (``with recorder.install(trainer): ...``).
- ``recorder.open_window()`` starts a window; microbatches recorded while a window is open
  belong to it (outside a window they are ignored).
- ``recorder.close_window(model)`` snapshots the gradient now in ``model``'s trainable
  parameters (float64 on the CPU, one flat vector; divided by the loss scale when the
  Trainer's accelerator holds an enabled GradScaler, since the snapshot comes before
  the Trainer unscales) and ends the window. It is idempotent
  per window: the clip wrapper calls it before the first clip of a sync step, and a
  callback's ``on_pre_optimizer_step`` may call it again harmlessly (with
  ``max_grad_norm=0`` there is no clip on older Trainers, so that call is the one that
  counts). Call it after the window's last backward pass and the data-parallel gradient
  sync, before the optimizer step.
- ``recorder.windows``: the closed :class:`CapturedWindow` objects, in order.

Memory: each recorded microbatch is kept (a clone of its tensors) and each window holds
one float64 copy of the trainable gradient, until the recorder is dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class RngState:
    """The torch generators' states: the CPU one and each CUDA device's (empty without CUDA)."""

    cpu: Tensor
    cuda: list[Tensor]

    @classmethod
    def now(cls) -> RngState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class Microbatch:
    """One ``training_step`` call: its inputs, the Trainer's count, the RNG state at entry."""

    inputs: dict[str, Any]
    num_items_in_batch: Tensor | int | None
    rng: RngState


@dataclass
class CapturedWindow:
    """One accumulation window as the Trainer ran it on this rank.

    ``gradient``: the trainable parameters' gradients after the window's last backward pass
    and the gradient sync, before clipping, flattened in ``named_parameters`` order into one
    float64 CPU vector (zeros for a parameter without a gradient); None until closed.
    """

    microbatches: list[Microbatch] = field(default_factory=list)
    gradient: Tensor | None = None


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter that requires grad, in a fixed order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def flat_gradient(model: nn.Module) -> Tensor:
    """The trainable parameters' ``.grad`` as one float64 CPU vector (zeros where None).

    A sharded gradient (DTensor) is gathered into the full tensor first.
    """
    parts = []
    for _, p in trainable_parameters(model):
        g = p.grad
        if g is None:
            parts.append(torch.zeros(p.numel(), dtype=torch.float64))
            continue
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        parts.append(g.detach().to("cpu", torch.float64).reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def clone_inputs(inputs: Any) -> Any:
    """A copy of a (nested) batch: tensors cloned, mappings and sequences rebuilt."""
    if isinstance(inputs, Tensor):
        return inputs.detach().clone()
    if isinstance(inputs, Mapping):
        return {k: clone_inputs(v) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(clone_inputs(v) for v in inputs)
    return inputs


class WindowRecorder:
    """Records microbatches and pre-clip gradients of a Trainer (see the module docstring)."""

    def __init__(self) -> None:
        self.windows: list[CapturedWindow] = []
        self._open: CapturedWindow | None = None
        self._model: nn.Module | None = None
        self._scaler: Any = None
        self._undo: list[tuple[object, str, bool, Any]] = []

    # -- windows ---------------------------------------------------------------------

    def open_window(self) -> None:
        """Start a window: microbatches recorded from now on belong to it."""
        self._open = CapturedWindow()

    @property
    def window_open(self) -> bool:
        return self._open is not None

    def close_window(self, model: nn.Module | None = None) -> CapturedWindow | None:
        """Snapshot the gradient of ``model`` (default: the installed trainer's model) and
        end the open window; returns it, or None when no window was open."""
        window, self._open = self._open, None
        if window is None:
            return None
        model = model if model is not None else self._model
        if model is None:
            raise ValueError("close_window needs the model whose gradient to snapshot")
        window.gradient = flat_gradient(model)
        if self._scaler is not None and self._scaler.is_enabled():
            # fp16 with a GradScaler: the gradient is still multiplied by the loss scale
            # here (the Trainer unscales inside the clip this snapshot comes before).
            window.gradient = window.gradient / float(self._scaler.get_scale())
        self.windows.append(window)
        return window

    def record(self, inputs: Mapping[str, Any], num_items_in_batch: Tensor | int | None) -> None:
        """Record one microbatch into the open window (ignored when none is open)."""
        if self._open is None:
            return
        nib = num_items_in_batch.detach().clone() if isinstance(num_items_in_batch, Tensor) else num_items_in_batch
        self._open.microbatches.append(Microbatch(clone_inputs(dict(inputs)), nib, RngState.now()))

    # -- hooks into a Trainer ----------------------------------------------------------

    def install(self, trainer: Any) -> contextlib.AbstractContextManager[WindowRecorder]:
        """Wrap ``trainer.training_step`` and ``trainer.accelerator.clip_grad_norm_``.

        Returns a context manager that calls :meth:`remove` on exit; calling ``install``
        without ``with`` leaves the wrappers until ``remove()``.
        """
        if self._undo:
            raise RuntimeError("this recorder is already installed; call remove() first")
        self._model = trainer.model
        step = trainer.training_step

        def training_step(model: nn.Module, inputs: Any, num_items_in_batch: Any = None, *a: Any, **k: Any) -> Any:
            self.record(inputs, num_items_in_batch)
            return step(model, inputs, num_items_in_batch, *a, **k)

        self._patch(trainer, "training_step", training_step)
        accelerator = getattr(trainer, "accelerator", None)
        self._scaler = getattr(accelerator, "scaler", None)
        if accelerator is not None and hasattr(accelerator, "clip_grad_norm_"):
            clip = accelerator.clip_grad_norm_

            def clip_grad_norm_(*a: Any, **k: Any) -> Any:
                if self._open is not None:
                    self.close_window()
                return clip(*a, **k)

            self._patch(accelerator, "clip_grad_norm_", clip_grad_norm_)
        return self._installed()

    @contextlib.contextmanager
    def _installed(self) -> Iterator[WindowRecorder]:
        try:
            yield self
        finally:
            self.remove()

    def _patch(self, obj: object, name: str, value: Any) -> None:
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def remove(self) -> None:
        """Undo :meth:`install`: the instance attributes are as they were before."""
        while self._undo:
            obj, name, had, old = self._undo.pop()
            if had:
                setattr(obj, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)


__all__ = [
    "CapturedWindow",
    "Microbatch",
    "RngState",
    "WindowRecorder",
    "clone_inputs",
    "flat_gradient",
    "trainable_parameters",
]
